"""Fine-tuning data for `rewrite train --data FILE.jsonl`: what each line trains.

A line is one example: `{"messages": [{"role": ..., "content": ...}, ...]}` (a conversation,
rendered by the tokenizer's chat template; the loss counts the assistant's turns only),
`{"prompt": ..., "completion": ...}` (the loss counts the completion and an EOS), or
`{"text": ...}` (every token, then an EOS). `packing.py` lays the examples into rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .byte_data import TrainConfigError

__all__ = ["Example", "is_tuning_file", "read_examples", "chat_example"]

FIELDS = ('{"messages": [{"role": ..., "content": ...}, ...]}', '{"prompt": ..., "completion": ...}', '{"text": ...}')


@dataclass(frozen=True)
class Example:
    """One line's tokens and which of them the loss counts (the model predicts them)."""

    ids: list[int]
    trained: list[bool]
    where: str  # "file:line", for messages


def is_tuning_file(path: str | Path) -> bool:
    """Whether `--data` is a fine-tuning file: a `.jsonl` whose first record has `messages` or `prompt`."""
    path = Path(path)
    if not (path.is_file() and path.suffix == ".jsonl"):
        return False
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False  # the text reader names the line
                return isinstance(record, dict) and ("messages" in record or "prompt" in record)
    return False


def read_examples(path: str | Path, tokenizer) -> list[Example]:
    """Every line of a fine-tuning `.jsonl`, tokenized, in file order.

    Raises:
        TrainConfigError: naming the file and line: not JSON, no known field, a field of the wrong
            kind, a conversation without an assistant turn, `messages` with a tokenizer that has no
            chat template, or a file with no example.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainConfigError(f"cannot read {str(path)!r}: {exc}") from None
    examples = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainConfigError(f"{where}: not JSON ({exc.msg}); write one JSON object per line") from None
        examples.append(_example(record, where, tokenizer))
    if not examples:
        raise TrainConfigError(f"--data {str(path)!r} holds no example (every line is empty); write one of "
                               f"{', '.join(FIELDS)} per line")
    return examples


def _example(record, where: str, tokenizer) -> Example:
    if isinstance(record, dict) and "messages" in record:
        return chat_example(record["messages"], tokenizer, where)
    if isinstance(record, dict) and ("prompt" in record or "completion" in record):
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise TrainConfigError(f'{where}: "prompt" and "completion" must both be strings, the completion not '
                                   f"empty; found {_kinds(record, ('prompt', 'completion'))}")
        head, tail = _encode(tokenizer, prompt), _encode(tokenizer, completion) + [_eos(tokenizer, where)]
        return Example(head + tail, [False] * len(head) + [True] * len(tail), where)
    if isinstance(record, dict) and isinstance(record.get("text"), str) and record["text"]:
        ids = _encode(tokenizer, record["text"]) + [_eos(tokenizer, where)]
        return Example(ids, [True] * len(ids), where)
    found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a {type(record).__name__}"
    raise TrainConfigError(f"{where}: no field to train on (found {found}); write one of {', '.join(FIELDS)}")


def _kinds(record: dict, keys) -> str:
    return ", ".join(f"{k}: {type(record.get(k)).__name__ if k in record else 'missing'}" for k in keys)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _eos(tokenizer, where: str) -> int:
    if tokenizer.eos_token_id is None:
        raise TrainConfigError(f"{where}: the tokenizer {type(tokenizer).__name__} has no EOS token to end the "
                               "example with; set eos_token in its tokenizer_config.json")
    return tokenizer.eos_token_id


def chat_example(messages, tokenizer, where: str = "messages") -> Example:
    """A conversation rendered by the tokenizer's chat template; the assistant's turns are trained.

    The assistant's tokens are found by rendering: turn `i` spans from the end of the conversation
    before it with the generation prompt (`add_generation_prompt=True`: the assistant's header)
    to the end of the conversation through it, so its content and the template's end of turn are
    trained and the header is not. A template must render each such prefix as the start of the
    whole conversation; one that does not is refused, naming the line.
    """
    _check_messages(messages, where)
    if not getattr(tokenizer, "chat_template", None):
        raise TrainConfigError(f"{where}: a conversation (\"messages\") needs the tokenizer's chat template, and "
                               f"{type(tokenizer).__name__} of --model has none; set tokenizer.chat_template and save "
                               "it, or write prompt/completion lines")

    def render(part, prompt: bool = False) -> str:
        if not part:
            return ""
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    whole = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = render(messages[:i], prompt=True), render(messages[: i + 1])
        if not (whole.startswith(through) and through.startswith(start)):
            raise TrainConfigError(f"{where}: the chat template does not render the conversation up to message {i} "
                                   "as the start of the whole, so its assistant tokens cannot be told apart")
        spans.append((len(start), len(through)))
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    trained = [any(a <= begin < b for a, b in spans) for begin, _ in offsets]
    return Example(list(ids), trained, where)


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise TrainConfigError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}}')
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise TrainConfigError(f'{where}: message {i} must be {{"role": "...", "content": "..."}} with strings, '
                                   f"found {message!r:.80}")
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise TrainConfigError(f"{where}: the conversation has no assistant message (roles: {roles}): nothing to "
                               "train on; the loss counts the assistant's turns only")
