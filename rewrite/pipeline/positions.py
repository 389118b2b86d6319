"""A microbatch of token ids, or token ids with their positions.

A microbatch is a tensor of token ids `[mb, seq]`, or a dict with `input_ids` and
`position_ids` of that shape: positions restart at 0 where a document starts, so documents
packed into one row attend only to themselves (the model's mask builders read the restarts,
as Hugging Face models do under `DataCollatorWithFlattening`). Every rank holds the same
microbatches, so every stage reads a microbatch's positions from its own copy: nothing but
hidden states crosses a stage boundary.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping, Sequence

import torch

from ..models.oracle import packing_problem

__all__ = ["KEYS", "ids_of", "positions_of", "document_ends", "positions_mark", "packing_of"]

KEYS = ("input_ids", "position_ids")


def ids_of(x):
    """The token ids of a microbatch (the tensor itself when it carries no positions)."""
    return x["input_ids"] if isinstance(x, Mapping) else x


def positions_of(x) -> torch.Tensor | None:
    """The microbatch's `position_ids`, or None: positions 0 .. seq - 1 in every row."""
    return x["position_ids"] if isinstance(x, Mapping) else None


def document_ends(position_ids: torch.Tensor) -> torch.Tensor:
    """`[b, s]` bool: the token is its document's last in the row (the next token starts
    another document, or the row ends): it has no next token to predict."""
    ends = torch.ones_like(position_ids, dtype=torch.bool)
    ends[:, :-1] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return ends


def positions_mark(inputs) -> int:
    """A digest of the microbatches' position_ids values (0 when none carries them; tensors on a
    device are not read, to spare a synchronisation: their positions go unchecked across ranks)."""
    if not isinstance(inputs, Sequence):
        return 0
    digest, seen = hashlib.blake2b(digest_size=8), False
    for i, x in enumerate(inputs):
        pos = x.get("position_ids") if isinstance(x, dict) else None
        if isinstance(pos, torch.Tensor) and pos.device.type == "cpu":
            digest.update(f"{i}:{tuple(pos.shape)}:{pos.dtype}".encode())
            digest.update(pos.detach().contiguous().numpy().tobytes())
            seen = True
    return int.from_bytes(digest.digest(), "little") >> 2 if seen else 0


_PACKING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> packing_problem(model), once


def packing_of(stage) -> str | None:
    """Why the stage's model cannot take packed documents (`models.oracle.packing_problem`, found
    once per model), or None."""
    if not stage.takes_token_ids:
        return None  # refused as a traced model's dicts
    if stage.model not in _PACKING:
        _PACKING[stage.model] = packing_problem(stage.model)
    return _PACKING[stage.model]
