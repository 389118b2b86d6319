"""Optimizer state as pieces: each moment in its parameter's box, so that it reshards with it."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..pipeline.stage import Stage
from .pieces import Piece, parameter_names, piece_like
from ..errors import CheckpointError

__all__ = ["optimizer_pieces", "fresh_optimizer_pieces", "fit_problems"]


def optimizer_pieces(stage: Stage, optimizer: torch.optim.Optimizer, boxes: dict[str, Piece]) -> tuple[dict, list[str]]:
    """Each parameter's optimizer state (moments in the parameter's box; 0-d values whole), under every name."""
    names, out, problems = parameter_names(stage.model), {}, []
    for param, state in optimizer.state.items():
        for name in names.get(id(param), []):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape):
                    out[f"optim/{name}/{key}"] = piece_like(value, boxes[name])
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    out[f"optim/{name}/{key}"] = Piece(value.detach(), torch.Size(), torch.Size())
                else:
                    problems.append(f"optimizer state {key!r} of {name} ({type(value).__name__}) is neither "
                                    "shaped like its parameter nor a scalar; it cannot be resharded")
    return out, problems


def fresh_optimizer_pieces(stage: Stage, optimizer, model_state: dict, stored: dict) -> tuple[dict, list]:
    """Zeroed optimizer state for every parameter the checkpoint has state for, boxed to be read into."""
    if optimizer.state:
        raise CheckpointError("the optimizer already has state; load into a fresh optimizer (before its first step)")
    names, pieces, fresh = parameter_names(stage.model), {}, []
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name in names.get(id(param), []):
                prefix = f"optim/{name}/"
                keys = [k for k in stored if k.startswith(prefix)]
                if not keys:
                    continue
                values = {}
                for key in keys:
                    md = stored[key]
                    if not isinstance(md, TensorStorageMetadata):
                        raise CheckpointError(f"{key} is not a tensor in the checkpoint")
                    dtype = md.properties.dtype
                    if len(md.size) == 0:
                        value = torch.zeros((), dtype=dtype)
                        pieces[key] = Piece(value, torch.Size(), torch.Size())
                    else:
                        value = torch.zeros_like(param, dtype=dtype)
                        pieces[key] = piece_like(value, model_state[f"model/{name}"])
                    values[key[len(prefix):]] = value
                fresh.append((param, values))
                break  # a tied parameter's state is read once, under its first name
    return pieces, fresh


def fit_problems(state: dict, stored: dict) -> list[str]:
    """Tensors of `state` the checkpoint lacks, or holds with another whole shape (another model)."""
    missing = [k for k in state if isinstance(state[k], Piece) and k not in stored]
    shapes = [
        f"{k}: {list(stored[k].size)} in the checkpoint, {list(v.size)} here"
        for k, v in state.items()
        if isinstance(v, Piece) and k in stored and tuple(getattr(stored[k], "size", ())) != tuple(v.size)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors this model has are not in the checkpoint, e.g. {missing[:3]}; "
                        "was it written for another model?")
    if shapes:
        problems.append(f"{len(shapes)} tensors have other whole shapes than the checkpoint's, e.g. {shapes[:3]}; "
                        "was it written for another model config?")
    return problems
