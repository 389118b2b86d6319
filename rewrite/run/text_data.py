"""Tokenized training text for `rewrite train --model DIR --data PATH`: documents from
text, JSON Lines or a saved `datasets` dataset, one token stream, shuffled windows.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import torch

from .byte_data import TrainConfigError
from .token_windows import EpochOrder, TokenWindows

__all__ = ["EpochOrder", "TokenWindows", "load_text_windows", "load_tokenizer", "read_documents", "tokenize_documents"]

_SUFFIXES = (".txt", ".jsonl")
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, BPE + merges.txt
_ENCODE_BATCH = 1024  # documents per call to the tokenizer: batched, yet bounded in memory


def read_documents(path: str | Path) -> list[str]:
    """The non-empty documents under `path`, in a fixed order.

    Args:
        path: a `.txt` file (the whole file is one document), a `.jsonl` file (one
            document per line, from its `"text"` field), a directory of such files (read
            recursively, sorted by path), or a directory written by `datasets`'
            `save_to_disk` (a DatasetDict gives its `train` split, else its only split).
    Returns:
        The documents, empty ones skipped.
    Raises:
        TrainConfigError: the path is missing or of another kind, a JSON line is bad,
            a dataset lacks a `text` column, or there is no text at all.

    Example:
        >>> len(read_documents("data/alice29.txt"))
        1
    """
    path = Path(path)
    if path.is_dir():
        if any((path / marker).is_file() for marker in _DATASET_MARKERS):
            documents = _read_saved_dataset(path)
        else:
            documents = [doc for file in _text_files(path) for doc in _read_file(file)]
    elif path.is_file():
        if path.suffix not in _SUFFIXES:
            raise TrainConfigError(
                f"--data {str(path)!r}: cannot read a {path.suffix or 'suffix-less'} file; pass a .txt file (one "
                "document), a .jsonl file (one {\"text\": ...} per line), a directory of them, or a saved dataset"
            )
        documents = _read_file(path)
    else:
        raise TrainConfigError(f"--data {str(path)!r} does not exist; pass a .txt or .jsonl file or a directory")
    documents = [doc for doc in documents if doc]
    if not documents:
        raise TrainConfigError(f"--data {str(path)!r} holds no text (every document is empty); pass a file with text")
    return documents


def _text_files(directory: Path) -> list[Path]:
    parts = {p: p.relative_to(directory).parts for p in directory.rglob("*") if p.is_file()}
    visible = [p for p, names in parts.items() if not any(name.startswith(".") for name in names)]
    # sorted by path components, the same on every Python: "a/b.txt" before "a-b.txt"
    files = sorted((p for p in visible if p.suffix in _SUFFIXES), key=parts.__getitem__)
    if not files:
        found = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        listing = ", ".join(found[:10]) + (f", ... ({len(found)} files)" if len(found) > 10 else "")
        raise TrainConfigError(
            f"--data {str(directory)!r} holds no .txt or .jsonl files (found: {listing or 'nothing'}); "
            "add text files, or pass a directory saved with datasets' save_to_disk"
        )
    return files


def _read_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TrainConfigError(f"{path}: byte {exc.start} is not UTF-8 ({exc.reason}); convert it to UTF-8") from None
    except OSError as exc:
        raise TrainConfigError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if path.suffix != ".jsonl":
        return [text]
    documents = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON allows a raw U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainConfigError(f"{path}:{number}: not JSON ({exc.msg}); write one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a {type(record).__name__}"
            raise TrainConfigError(
                f'{path}:{number}: needs a string field "text", found {found}; write each line as {{"text": "..."}}'
            )
        documents.append(record["text"])
    return documents


def _read_saved_dataset(path: Path) -> list[str]:
    where = f"--data {str(path)!r}"
    try:
        import datasets
    except ImportError:
        raise TrainConfigError(
            f'{where} is a saved dataset, but `datasets` is not installed; pip install "rewrite[data]"'
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise TrainConfigError(f"{where} looks like a saved dataset but does not load: {exc}; save it again") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            raise TrainConfigError(
                f"{where} is a DatasetDict with splits {splits} and no 'train' split; "
                "save the split to train on alone, or name one 'train'"
            )
    if "text" not in loaded.column_names:
        raise TrainConfigError(
            f"{where} has columns {loaded.column_names} and no 'text' column; "
            "rename the column holding the text to 'text' (dataset.rename_column(old, 'text'))"
        )
    feature = loaded.features["text"]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise TrainConfigError(f"{where}: column 'text' is {feature}, not strings; store the text as strings")
    return [doc for doc in loaded["text"] if doc]


def tokenize_documents(documents: list[str], tokenizer) -> torch.Tensor:
    """One token stream: each document's ids, then the tokenizer's EOS id.

    The tokenizer adds no special tokens of its own (`add_special_tokens=False`), so the
    EOS after each document is the only separator the model sees.

    Args:
        documents: the texts, in order.
        tokenizer: a Hugging Face tokenizer with an EOS token.
    Returns:
        The ids, shape `(n,)`, int64.
    Raises:
        TrainConfigError: the tokenizer has no EOS token.

    Example:
        >>> tokenize_documents(["a b", "c"], tokenizer)  # doctest: +SKIP
        tensor([64, 291, 1, 66, 1])  # e.g. "a", " b", </s>, "c", </s>
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TrainConfigError(
            f"the tokenizer {type(tokenizer).__name__} has no EOS token to separate documents; "
            "set eos_token in its tokenizer_config.json, or make a model with `rewrite init-model`"
        )
    stream = array("q")
    for start in range(0, len(documents), _ENCODE_BATCH):
        batch = documents[start : start + _ENCODE_BATCH]
        # verbose=False: documents longer than model_max_length are expected, windows cut them later
        for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(eos)
    if not stream:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(stream, dtype=torch.int64).clone()  # no per-element copy


def load_text_windows(data_path: str | Path, tokenizer_dir: str | Path, *, seq_len: int, seed: int) -> TokenWindows:
    """The documents at `data_path`, tokenized with the tokenizer in `tokenizer_dir`, as windows.

    Args:
        data_path: anything `read_documents` reads.
        tokenizer_dir: a model directory holding a Hugging Face tokenizer.
        seq_len, seed: as for `TokenWindows`.
    Returns:
        The windows; take batches with `take(cursor, count)`.
    Raises:
        TrainConfigError: no tokenizer in `tokenizer_dir`, or an error of `read_documents`,
            `tokenize_documents` or `TokenWindows`.

    Example:
        >>> windows = load_text_windows("data/alice29.txt", "tiny", seq_len=128, seed=0)  # doctest: +SKIP
    """
    stream = tokenize_documents(read_documents(data_path), load_tokenizer(tokenizer_dir))
    return TokenWindows(stream, seq_len, seed)


def load_tokenizer(tokenizer_dir: str | Path):
    """The Hugging Face tokenizer in a model directory.

    Raises:
        TrainConfigError: the directory holds none, or it does not load.
    """
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    if not any((tokenizer_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise TrainConfigError(
            f"--model {str(tokenizer_dir)!r} holds no tokenizer: it needs tokenizer.json (or tokenizer.model, "
            "or vocab.json and merges.txt) beside tokenizer_config.json; save one there with "
            "tokenizer.save_pretrained(DIR), or make a model directory with one by `rewrite init-model DIR`"
        )
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise TrainConfigError(f"--model {str(tokenizer_dir)!r}: cannot load its tokenizer: {exc}") from None
