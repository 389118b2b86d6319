"""Tokenized training text for `rewrite train --model DIR --data PATH`: documents from
text, JSON Lines or a saved `datasets` dataset, one token stream, shuffled windows.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import torch

from .byte_data import TrainConfigError

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


class EpochOrder:
    """`count` items drawn in shuffled epochs: position `p` of the endless sequence is item
    `perm_e[p % count]` of epoch `e = p // count`, `perm_e = torch.randperm(count)` seeded with
    `seed * 1_000_003 + e`. A position (the cursor) is all a resumed run needs."""

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed = count, seed
        self._perms: dict[int, torch.Tensor] = {}  # epoch -> permutation, the last two used

    def permutation(self, epoch: int) -> torch.Tensor:
        """The item order of `epoch`, shape `(count,)`."""
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            if len(self._perms) >= 2:
                del self._perms[next(iter(self._perms))]  # oldest first: dicts keep insertion order
            self._perms[epoch] = torch.randperm(self.count, generator=generator)
        return self._perms[epoch]

    def items(self, cursor: int, count: int) -> torch.Tensor:
        """The items at positions `cursor .. cursor + count - 1`, shape `(count,)`.

        Raises:
            ValueError: a negative cursor or count.
        """
        if cursor < 0 or count < 0:
            raise ValueError(f"take(cursor={cursor}, count={count}): both must be >= 0")
        positions = torch.arange(cursor, cursor + count)  # (count,)
        epochs, slots = positions // self.count, positions % self.count
        chosen = torch.empty(count, dtype=torch.int64)
        for epoch in epochs.unique().tolist():
            here = epochs == epoch
            chosen[here] = self.permutation(epoch)[slots[here]]
        return chosen


class TokenWindows:
    """A token stream cut into windows of `seq_len + 1` tokens, drawn in shuffled epochs.

    Window `i` is `stream[i*seq_len : i*seq_len + seq_len + 1]`: consecutive windows share
    one token, so each token but the first is a target exactly once per epoch, save a
    dropped tail shorter than a window. Position `p` of the endless sequence of
    windows is window `perm_e[p % n]` of epoch `e = p // n`, where `perm_e` is
    `torch.randperm(n)` seeded with `seed * 1_000_003 + e`.

    The cursor (how many windows were taken so far) is the only state: a resumed run
    rebuilds the windows from the same text, seq_len and seed and passes the cursor it
    saved, and gets the same batches the first run would have, in any process.

    Example:
        >>> windows = TokenWindows(torch.arange(100), seq_len=8, seed=0)
        >>> inputs, targets = windows.take(0, 4)  # (4, 8) each; next call: take(4, ...)
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int) -> None:
        if stream.dim() != 1:
            raise ValueError(f"the token stream must be 1-D, got shape {tuple(stream.shape)}")
        if seq_len < 1:
            raise TrainConfigError(f"seq_len={seq_len} must be at least 1")
        count = (len(stream) - 1) // seq_len
        if count < 1:
            fix = f"use seq_len <= {len(stream) - 1} or pass more text" if len(stream) >= 2 else "pass more text"
            raise TrainConfigError(
                f"the training text is {len(stream)} tokens, too few for one window of seq_len + 1 = "
                f"{seq_len + 1} tokens; {fix}"
            )
        self.stream = stream.long()
        self.seq_len = seq_len
        self.seed = seed
        self._order = EpochOrder(count, seed)

    def __len__(self) -> int:
        return self._order.count

    def permutation(self, epoch: int) -> torch.Tensor:
        """The window order of `epoch`, shape `(len(self),)`."""
        return self._order.permutation(epoch)

    def take(self, cursor: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows at positions `cursor .. cursor + count - 1`, as inputs and targets.

        Returns:
            `(inputs, targets)`, each `(count, seq_len)` int64, `targets[:, :-1] == inputs[:, 1:]`.
        Raises:
            ValueError: a negative cursor or count.
        """
        windows = self._order.items(cursor, count)
        offsets = torch.arange(self.seq_len + 1)  # (seq + 1,)
        tokens = self.stream[windows.unsqueeze(1) * self.seq_len + offsets]  # (count, seq + 1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


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
