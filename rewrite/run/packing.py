"""Fine-tuning examples laid into rows of `--seq-len` tokens, and drawn as `rewrite train`'s batches.

Packed (the default), a row holds several examples, each its own document: its positions
restart at 0, so it attends only to itself (`rewrite.microbatches(..., position_ids=)`), and its
first token predicts nothing of the one before. Unpacked (`--no-pack`), a row holds one example
and padding. Padding is never trained (-100). An example longer than a row is split into rows'
lengths, each piece its own document; a piece with nothing to train (a prompt's middle) is
dropped. The counts are kept for the run's header.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import torch

from ..pipeline.batches import microbatches
from ..tensor_parallel.loss import IGNORE_INDEX
from .byte_data import TrainConfigError
from .text_data import load_tokenizer
from .token_windows import EpochOrder
from .tuning_data import Example, read_examples

__all__ = ["Rows", "pack_examples", "TuningBatches"]


@dataclass(frozen=True)
class Rows:
    """Examples laid into rows: `ids`, `positions` and `labels` (-100 untrained), each `[rows, seq_len]`."""

    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    examples: int  # lines read
    documents: int  # pieces laid into rows (an example split in two counts twice)
    split: int  # examples longer than a row, split
    dropped: int  # pieces with no token to train, left out
    tokens: int  # tokens in the rows, padding left out
    trained: int  # tokens the loss counts (each predicted from the one before it, in its document)

    def __len__(self) -> int:
        return self.ids.shape[0]


def _pieces(examples: list[Example], seq_len: int) -> tuple[list[tuple[list[int], list[bool]]], int, int]:
    """(pieces of at most seq_len tokens with something to train, examples split, pieces dropped)."""
    pieces, split, dropped = [], 0, 0
    for ex in examples:
        split += len(ex.ids) > seq_len
        for start in range(0, len(ex.ids), seq_len):
            ids, trained = ex.ids[start : start + seq_len], ex.trained[start : start + seq_len]
            if any(trained[1:]):  # a document's first token is predicted by nothing
                pieces.append((ids, trained))
            else:
                dropped += 1
    return pieces, split, dropped


def pack_examples(examples: list[Example], seq_len: int, *, pad_id: int, seed: int, pack: bool = True) -> Rows:
    """Lay `examples` into rows of `seq_len` tokens: shuffled by `seed`, then each into the fullest
    row it fits (best fit), or one a row when `pack` is False.

    Raises:
        TrainConfigError: nothing to train in any example.
    """
    pieces, split, dropped = _pieces(examples, seq_len)
    if not pieces:
        raise TrainConfigError(f"no example has a token to train at --seq-len {seq_len} (every one is a prompt "
                               "alone, or a single token); check the data's assistant turns or completions")
    order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(seed)).tolist()
    rows: list[list[int]] = []  # piece indices per row
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted: the best fit is the first with enough
    for p in order:
        size = len(pieces[p][0])
        at = bisect.bisect_left(room, (size, -1)) if pack else len(room)
        if at == len(room):
            rows.append([p])
            free, row = seq_len - size, len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(p)
            free -= size
        if pack and free > 0:
            bisect.insort(room, (free, row))
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    positions = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, members in enumerate(rows):
        at = 0
        for p in members:
            piece, trained = pieces[p]
            end = at + len(piece)
            ids[r, at:end] = torch.tensor(piece)
            positions[r, at:end] = torch.arange(len(piece))
            labels[r, at:end] = torch.where(torch.tensor(trained), ids[r, at:end], IGNORE_INDEX)
            at = end
        positions[r, at:] = torch.arange(seq_len - at)  # the padding: a document of its own, never trained
    tokens = sum(len(p[0]) for p in pieces)
    trained = sum(sum(t[1:]) for _, t in pieces)
    return Rows(ids, positions, labels, len(examples), len(pieces), split, dropped, tokens, trained)


class TuningBatches:
    """`rewrite train`'s batches from a fine-tuning `.jsonl` (`tuning_data`): rows drawn in shuffled
    epochs by the seed; the cursor is the position in them, as for text windows."""

    def __init__(self, data: str | Path, tokenizer_dir: Path, *, seq_len: int, seed: int, pack: bool = True):
        tokenizer = load_tokenizer(tokenizer_dir)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.rows = pack_examples(read_examples(data, tokenizer), seq_len, pad_id=pad or 0, seed=seed, pack=pack)
        self.pack, self.order = pack, EpochOrder(len(self.rows), seed)
        r = self.rows
        self.what = (f"tokens of {data} ({r.examples} examples in {len(r)} rows, "
                     f"{'packed' if pack else 'one a row (--no-pack)'}"
                     + (f"; {r.split} longer than --seq-len {seq_len}, split" if r.split else "")
                     + (f"; {r.dropped} pieces with nothing to train left out" if r.dropped else "") + ")")

    def problems(self, vocab_size: int) -> list[str]:
        top = int(self.rows.ids.max())
        if vocab_size and top >= vocab_size:
            return [f"the tokenizer gives id {top}, outside the model's vocabulary of {vocab_size}; "
                    "train a model whose embedding covers its tokenizer"]
        return []

    def per_step(self, sequences: int) -> str:
        """What a step of `sequences` rows holds, on average over the data."""
        r, share = self.rows, sequences / len(self.rows)
        return (f"a step of {sequences} rows holds about {r.documents * share:,.1f} documents, "
                f"{r.tokens * share:,.0f} tokens and {r.trained * share:,.0f} trained (counted by the loss)")

    def take(self, step: int, cursor: int, sequences: int, batch_size: int):
        chosen = self.order.items(cursor, sequences)
        r = self.rows
        return microbatches(r.ids[chosen], sequences // batch_size, labels=r.labels[chosen],
                            position_ids=r.positions[chosen] if self.pack else None)
