"""Checkpoints in transformers' on-disk layout: a family's conversion mapping, read and written.

transformers 5 stores some tensors under other names or shapes than it holds them
(`transformers.conversion_mapping`): renamings, and chiefly experts stored one tensor per expert
and projection (`mlp.experts.7.gate_proj.weight`) but held as one (`mlp.experts.gate_up_proj
[E, 2I, H]`). Reading (`stored_names`) matches keys with transformers' `rename_source_key` and
reads the experts converters (`MergeModulelist(dim=0)`, then `Concatenate(dim=1)`) as `Stacked`
pieces, each rank only its experts; any other converter is named as not read. Writing
(`on_disk`) uses `revert_weight_conversion` when every converter of the family is read here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..models.names import canonical_names
from ..plan.wording import first_few
from .layout import meta_model

__all__ = ["Stored", "Stacked", "Source", "stored_names", "stored_keys", "on_disk"]


@dataclass(frozen=True)
class Stored:
    """A tensor stored under `key` in safetensors file `path` (a base weight, a PEFT adapter's factor): this
    rank's slice read, cast to `dtype` when set (an adapter: the base's)."""

    path: Path
    key: str
    dtype: torch.dtype | None = None

    @property
    def order(self) -> tuple[Path, str]:
        """Where it is read from: reads sorted by it go through the files in order."""
        return self.path, self.key

    def read(self, entry) -> torch.Tensor:
        """This rank's slice (`layout.Entry`), only that read from the file."""
        # A handle per tensor: safetensors maps the file, and the pages a read touched stay
        # resident until the mapping goes, so holding one open would keep them all.
        with safe_open(str(self.path), framework="pt") as f:
            data = entry.cut(f.get_slice(self.key))
        return data if self.dtype is None else data.to(self.dtype)


@dataclass(frozen=True)
class Stacked:
    """A model tensor stored in pieces: its row `e` (dim 0) is expert e's pieces side by side along
    their dim 0 (gate, then up), each a (file, key) of the checkpoint."""

    pieces: tuple[tuple[tuple[Path, str], ...], ...]  # [expert][projection]

    @property
    def order(self) -> tuple[Path, str]:
        return self.pieces[0][0]

    def read(self, entry) -> torch.Tensor:
        """This rank's rows (experts: all, or its slices' along dim 0; `layout.Entry`), each read from its own
        pieces only (each file opened once); split along another dim (each expert over tp), its slices of each."""
        rows = range(len(self.pieces)) if entry.dim != 0 else [r for s in entry.slices() for r in range(s.start, s.stop)]
        by_file: dict[Path, list[str]] = {}
        for row in rows:
            for path, key in self.pieces[row]:
                by_file.setdefault(path, []).append(key)
        read = {}
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                read.update({(path, key): f.get_tensor(key) for key in keys})
        whole = [torch.cat([read[p] for p in self.pieces[row]]) for row in rows]  # each expert's row
        return torch.stack(whole if entry.dim == 0 else [entry.cut(row, lead=1) for row in whole])

    def problems(self, name: str, full_shape: tuple[int, ...]) -> list[str]:
        """What keeps this rank from reading model tensor `name` (`full_shape`) from the pieces."""
        if len(self.pieces) != full_shape[0]:
            return [f"{name}: the checkpoint stores {len(self.pieces)} experts, config.json implies {full_shape[0]}; "
                    "the config and the weights do not belong together"]
        shapes = {}
        for path in sorted({p for row in self.pieces for p, _ in row}):
            try:
                with safe_open(str(path), framework="pt") as f:
                    keys = set(f.keys())
                    shapes.update({(path, k): tuple(f.get_slice(k).get_shape()) for p, k in
                                   (piece for row in self.pieces for piece in row) if p == path and k in keys})
            except Exception as exc:  # SafetensorError or OSError
                return [f"{path}: unreadable ({exc}); the file is missing, corrupted or truncated: copy it again"]
        for row, pieces in enumerate(self.pieces):
            got = [shapes.get(p) for p in pieces]
            if None in got:
                return [f"{pieces[got.index(None)][0]}: no tensor {pieces[got.index(None)][1]!r}, though the index maps "
                        "it there; re-save the checkpoint"]
            if sum(s[0] for s in got) != full_shape[1] or any(tuple(s[1:]) != tuple(full_shape[2:]) for s in got):
                return [f"{name}: expert {row}'s pieces {[list(s) for s in got]} do not make a row of "
                        f"{list(full_shape[1:])} (config.json); the config and the weights do not belong together"]
        return []


# A tensor in a file, pieces per expert, or anything else that reads an entry's slice itself (`read(entry)`)
# and says where it reads first (`order`): a fresh LoRA adapter factor (`adapter_read.Drawn`).
Source = Stored | Stacked


def _mapping(model: nn.Module, *, legacy: bool):
    """(renamings, converters) of `model`'s family, or None when transformers has no conversion for it."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
        transforms = get_model_conversion_mapping(model, add_legacy=legacy)
    except (ImportError, AttributeError, TypeError):
        return None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return (renamings, converters) if transforms else None


def _unread(converter) -> str | None:
    """Why a converter's tensors are not read here (its operations, in words); None when they are."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
        return None
    return " then ".join(f"{name}(dim={dim})" if dim is not None else name for name, dim in ops)


def _expert(pattern: str, key: str) -> int | None:
    """The expert index `*` stands for in `key`, matched by the converter's source `pattern`."""
    if "*" not in pattern:
        return None
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(found.group(1)) if found else None


def stored_names(model: nn.Module, weight_map: dict[str, str], directory: Path) -> tuple[dict, list[str]]:
    """Where the checkpoint stores each tensor of `model` it does not hold under the tensor's name (or the name
    of the tensor it is tied to): a checkpoint key (renamed), `Stacked` pieces, or None when it is stored in a
    layout not read here; and the problems with those. `model`: the meta model of the checkpoint's config."""
    canonical, names = canonical_names(model), set(model.state_dict(keep_vars=True))
    missing = {n for n in names if n not in weight_map and canonical.get(n, n) not in weight_map}
    mapping = _mapping(model, legacy=True) if missing else None
    if mapping is None:
        return {}, []
    from transformers.core_model_loading import rename_source_key

    renamings, converters = mapping
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    found: dict[str, object] = {}
    parts: dict[str, dict[int, dict[str, str]]] = {}  # model name -> expert -> source pattern -> key
    made_by: dict[str, object] = {}
    for key in weight_map:
        if key in names:
            continue
        name, pattern = rename_source_key(key, renamings, converters)
        if name not in missing:
            continue
        if pattern is None:
            found[name] = key
            continue
        expert = _expert(pattern, rename_source_key(key, renamings, [])[0])  # matched on the renamed key
        made_by[name] = by_pattern[pattern]
        parts.setdefault(name, {}).setdefault(-1 if expert is None else expert, {})[pattern] = key
    problems, unread = [], {}
    for name, experts in sorted(parts.items()):
        converter = made_by[name]
        why = _unread(converter)
        if why is not None or -1 in experts:
            made = sorted(n for n in missing if n == name or any(t in n for t in converter.target_patterns))
            unread.setdefault((why or "a converter", tuple(converter.source_patterns)), set()).update(made)
            found.update(dict.fromkeys(made))  # reported here, not again as missing
            continue
        order = list(converter.source_patterns)
        gaps = [f"expert {e}: {p}" for e in range(max(experts) + 1) for p in order if p not in experts.get(e, {})]
        if gaps:
            problems.append(f"{directory}: {name!r} is stored one piece per expert, and pieces are missing "
                            f"({', '.join(gaps[:3])}); copy the complete checkpoint")
            continue
        found[name] = Stacked(tuple(tuple((directory / weight_map[experts[e][p]], experts[e][p]) for p in order)
                                    for e in range(max(experts) + 1)))
    for (why, sources), names in unread.items():
        problems.append(
            f"{directory}: {first_few(map(repr, sorted(names)), 2)} are stored in transformers' on-disk layout, made "
            f"by {why} from {list(sources)}, which rewrite does not read; load the checkpoint with transformers once "
            "and save it with rewrite.save_pretrained on one process, which writes the in-memory layout")
    return found, problems


def stored_keys(found: dict) -> list[str]:
    """The checkpoint keys `stored_names`' answer reads."""
    return [k for v in found.values() if v is not None
            for k in ([v] if isinstance(v, str) else [key for row in v.pieces for _, key in row])]


def on_disk(config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (whole, in-memory names) as transformers stores them for the family of `config`, when
    `stored_names` reads that layout back (every converter of the family is read here); else as they are
    (a model transformers' auto classes do not build from its config included)."""
    try:
        model = meta_model(config)
    except (ValueError, KeyError, TypeError, AttributeError):
        return tensors
    mapping = _mapping(model, legacy=False)
    if mapping is None or any(_unread(c) for c in mapping[1]):
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)
