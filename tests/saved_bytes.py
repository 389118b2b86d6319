"""What autograd keeps for a backward: the bytes of the storages a forward saves."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_bytes(forward: Callable[[], object], leave_out: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while `forward()` runs, those of `leave_out` (the
    parameters, shared cos / sin) not counted."""
    skip = {t.untyped_storage().data_ptr() for t in leave_out}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(saved.values())
