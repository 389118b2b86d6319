"""Fine-tuning data: what each `.jsonl` line trains (the assistant's turns, by transformers' own
assistant mask as the oracle; a completion; all of a text), the refusals naming file and line, and
the examples laid into rows (packed or one a row) with every trained token counted once."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from rewrite.run.byte_data import TrainConfigError
from rewrite.run.packing import TuningBatches, pack_examples
from rewrite.run.tuning_data import Example, chat_example, is_tuning_file, read_examples
from tests.paths import ROOT

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who fell?"},
        {"role": "assistant", "content": "Alice did."}, {"role": "user", "content": "Where to?"},
        {"role": "assistant", "content": "Down the rabbit hole."}]


def _write(path, lines) -> str:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_a_conversation_trains_what_transformers_marks_as_the_assistants(tokenizer):
    example = chat_example(CHAT, tokenizer)
    marked = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert example.ids == list(marked["input_ids"])
    assert example.trained == [bool(m) for m in marked["assistant_masks"]]
    trained = tokenizer.decode([i for i, t in zip(example.ids, example.trained) if t])
    assert trained == "Alice did.</s>Down the rabbit hole.</s>"


def test_each_kind_of_line(tmp_path, tokenizer):
    path = _write(tmp_path / "mixed.jsonl", [
        {"messages": CHAT}, "", {"prompt": "Q: 2 + 2?\nA:", "completion": " 4"}, {"text": "Once upon a time."}])
    chat, completion, text = read_examples(path, tokenizer)
    assert chat.where.endswith("mixed.jsonl:1") and completion.where.endswith("mixed.jsonl:3")
    assert tokenizer.decode([i for i, t in zip(completion.ids, completion.trained) if t]) == " 4</s>"
    assert tokenizer.decode(completion.ids) == "Q: 2 + 2?\nA: 4</s>"
    assert all(text.trained) and tokenizer.decode(text.ids) == "Once upon a time.</s>"
    assert is_tuning_file(path) and not is_tuning_file(_write(tmp_path / "text.jsonl", [{"text": "a"}]))
    assert not is_tuning_file(ROOT / "data" / "alice29.txt")


@pytest.mark.parametrize(("lines", "message"), [
    (["{not json"], r"bad.jsonl:1: not JSON"),
    ([{"messages": CHAT}, {"question": "?"}], r"bad.jsonl:2: no field to train on \(found keys \['question'\]\)"),
    ([{"messages": CHAT[:2]}], r"bad.jsonl:1: the conversation has no assistant message \(roles: system, user\)"),
    ([{"messages": [{"role": "user", "content": 3}]}], r"bad.jsonl:1: message 0 must be"),
    ([{"messages": []}], r"bad.jsonl:1: \"messages\" must be a non-empty list"),
    ([{"prompt": "Q", "completion": ""}], r"bad.jsonl:1: \"prompt\" and \"completion\" must both be strings"),
    ([{"prompt": "Q"}], r"completion: missing"),
    (["", "  "], r"holds no example"),
])
def test_bad_lines_are_refused_naming_file_and_line(tmp_path, tokenizer, lines, message):
    with pytest.raises(TrainConfigError, match=message):
        read_examples(_write(tmp_path / "bad.jsonl", lines), tokenizer)


def test_a_conversation_needs_a_chat_template(tmp_path, tokenizer):
    plain = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    with pytest.raises(TrainConfigError, match=r"c.jsonl:1: a conversation \(\"messages\"\) needs the tokenizer's chat "
                       "template"):
        read_examples(_write(tmp_path / "c.jsonl", [{"messages": CHAT}]), plain)


def _examples():
    # Lengths 3..12, every other token trained; one of 20 tokens (longer than a row of 8).
    out = [Example(list(range(100 * n, 100 * n + n)), [k % 2 == 1 for k in range(n)], f"f:{n}") for n in range(3, 13)]
    out.append(Example(list(range(5000, 5020)), [True] * 20, "f:long"))
    out.append(Example([7, 8, 9], [True, False, False], "f:nothing"))  # only its first token: nothing predicted
    return out


def _kept_pieces(examples, seq_len):
    """Each example cut into seq_len pieces; those with a token predicted from the one before kept."""
    out = []
    for ex in examples:
        for start in range(0, len(ex.ids), seq_len):
            ids, trained = ex.ids[start : start + seq_len], ex.trained[start : start + seq_len]
            if any(trained[1:]):
                out.append((tuple(ids), tuple(trained)))
    return out


def _segments(rows, r):
    """Row r cut where positions restart: (ids, labels, positions) per document."""
    starts = [k for k in range(rows.ids.shape[1]) if rows.positions[r, k] == 0] + [rows.ids.shape[1]]
    return [(rows.ids[r, a:b].tolist(), rows.labels[r, a:b].tolist(), rows.positions[r, a:b].tolist())
            for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("pack", [True, False])
def test_examples_lie_in_rows_once_with_their_positions_and_labels(pack):
    examples, pad = _examples(), -1
    rows = pack_examples(examples, 8, pad_id=pad, seed=3, pack=pack)
    kept = _kept_pieces(examples, 8)
    assert rows.ids.shape == rows.labels.shape == rows.positions.shape == (len(rows), 8)
    assert (rows.examples, rows.split, rows.dropped, rows.documents) == (12, 5, 2, len(kept))
    found = []
    for r in range(len(rows)):
        documents = [s for s in _segments(rows, r) if s[0][0] != pad]
        assert not pack or documents, f"row {r} holds no document"
        if not pack:
            assert len(documents) == 1, f"--no-pack: row {r} holds {len(documents)} documents"
        for ids, labels, positions in _segments(rows, r):
            assert positions == list(range(len(ids)))
            if ids[0] == pad:  # the padding: never trained
                assert set(ids) == {pad} and set(labels) == {-100}
                continue
            trained = tuple(label != -100 for label in labels)
            assert all(label in (-100, i) for label, i in zip(labels, ids))
            found.append((tuple(ids), trained))
    assert Counter(found) == Counter(kept), "every piece with something to train lies in the rows exactly once"
    assert rows.tokens == sum(len(ids) for ids, _ in kept)
    assert rows.trained == sum(sum(trained[1:]) for _, trained in kept)
    assert (len(rows) < len(kept)) == pack  # packing shares rows; one a row does not
    again = pack_examples(examples, 8, pad_id=pad, seed=3, pack=pack)
    assert torch.equal(again.ids, rows.ids) and torch.equal(again.labels, rows.labels)
    assert not torch.equal(pack_examples(examples, 8, pad_id=pad, seed=4, pack=pack).ids, rows.ids)


def test_batches_predict_nothing_across_documents(tmp_path, checkpoint):
    data = TuningBatches(str(ROOT / "data" / "chat-sums.jsonl"), checkpoint, seq_len=128, seed=0)
    inputs, targets = data.take(1, 0, 8, 2)
    assert len(inputs) == 4 and all(sorted(x) == ["input_ids", "position_ids"] for x in inputs)
    for x, y in zip(inputs, targets):
        positions = x["position_ids"]
        last = torch.ones_like(positions, dtype=torch.bool)
        last[:, :-1] = positions[:, 1:] == 0  # the token before a document starts
        assert (y[last] == -100).all(), "a document's last token predicts nothing of the next"
        assert (y != -100).any()
    assert "a step of 8 rows holds about" in data.per_step(8) and "trained (counted by the loss)" in data.per_step(8)
    plain = TuningBatches(str(ROOT / "data" / "chat-sums.jsonl"), checkpoint, seq_len=128, seed=0, pack=False)
    inputs, targets = plain.take(1, 0, 4, 2)
    assert all(isinstance(x, torch.Tensor) for x in inputs), "--no-pack: one document a row, no positions needed"
    assert len(plain.rows) == 240 and "one a row (--no-pack)" in plain.what
