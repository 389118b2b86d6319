"""Point-to-point transfers between pipeline stages (torch.distributed isend/irecv), received in
the order each peer sends.

When a receiver knows the shape (Hugging Face stages: `[mb, seq, hidden]`) only
the tensor travels. Otherwise a small int64 header with the dtype and shape goes
first, so stages of arbitrary traced modules need no shape declarations.

Transfers between two ranks are matched in the order they are posted, so each rank
posts its receives from a peer in the order the peer's row of the schedule sends
them: every rank holds the whole table, so it knows that order. A rank may then
consume them in its own order (a message it needs later is simply held). A
message is a key `(kind, mb, stage)`: "F" the activation entering `stage`, "B" the
gradient of `stage`'s output (sent by the next stage's B or I); with a mixture of experts'
router loss, "f" and "b" right after each: the router sums beside them (`router_sums`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..doing import doing
from ..schedules import Action

__all__ = ["send", "recv", "wait", "send_header", "decode_header", "HEADER_SHAPE", "Inbox", "messages_between"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
HEADER_SHAPE = (2 + _MAX_DIMS,)  # ndim, dtype code, then the sizes, padded with -1


def send(tensor: torch.Tensor, dst: int) -> list[dist.Work]:
    """Start sending `tensor` to global rank `dst`; keep `tensor` alive until the works finish."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, dst)])


def recv(src: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[dist.Work]]:
    """Start receiving a tensor from global rank `src` into a new buffer."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    return buffer, dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, src)])


def send_header(tensor: torch.Tensor, dst: int) -> tuple[list[dist.Work], torch.Tensor]:
    """Start sending `tensor`'s dtype and shape to `dst`; returns the works and the header to keep alive."""
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise ValueError(
            f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims between stages; "
            f"supported: {_MAX_DIMS} dims at most, dtypes {[str(d) for d in _DTYPES]}"
        )
    values = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape]
    header = torch.tensor(values + [-1] * (2 + _MAX_DIMS - len(values)), dtype=torch.int64, device=tensor.device)
    return send(header, dst), header


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) from a header received into a `HEADER_SHAPE` int64 buffer."""
    ndim, code, *sizes = header.tolist()
    return tuple(sizes[:ndim]), _DTYPES[code]


Key = tuple[str, int, int]  # (kind, mb, stage)


def messages_between(row: Sequence[Action], stage_rank: Sequence[int], src: int, dst: int,
                     sums: bool = False) -> list[Key]:
    """What pp rank `src` sends pp rank `dst`, in the order its `row` sends it (`sums`: router sums too)."""
    last, out = len(stage_rank) - 1, []
    for action in row:
        if action.kind == "F" and action.stage < last and stage_rank[action.stage + 1] == dst != src:
            out.extend((k, action.mb, action.stage + 1) for k in ("F", "f")[:1 + sums])
        elif action.kind in ("B", "I") and action.stage > 0 and stage_rank[action.stage - 1] == dst != src:
            out.extend((k, action.mb, action.stage - 1) for k in ("B", "b")[:1 + sums])
    return out


class Inbox:
    """Receives from global rank `src`, posted in `order`, one ahead of what was taken.

    `shape_of(key)` gives `(shape, dtype)` when known, else None. An activation of
    unknown shape (traced models) comes after a header announcing it; a gradient's
    shape is known once this rank ran the forward it belongs to, which always
    happens before its sender can send it.
    """

    def __init__(self, src: int, order: list[Key], shape_of: Callable, device: torch.device):
        self.src, self.order, self.shape_of, self.device = src, order, shape_of, device
        self.index = {key: i for i, key in enumerate(order)}
        self.posted: dict[int, list] = {}  # index -> [kind "data" | "header", buffer, works]
        self.frontier = 0  # the next index to post
        self._post()

    def _post(self) -> bool:
        """Post the next receive in order; False when it cannot be posted yet."""
        i = self.frontier
        if i >= len(self.order) or any(kind == "header" for kind, _, _ in self.posted.values()):
            return False  # the data after a header must be posted before anything later
        known = self.shape_of(self.order[i])
        if known is not None:
            self.posted[i] = ["data", *recv(self.src, known[0], known[1], self.device)]
        elif self.order[i][0] == "F":
            self.posted[i] = ["header", *recv(self.src, HEADER_SHAPE, torch.int64, self.device)]
        else:
            return False
        self.frontier += 1
        return True

    def _resolve_header(self) -> bool:
        for i, entry in self.posted.items():
            if entry[0] == "header":
                wait(entry[2])
                self.posted[i] = ["data", *recv(self.src, *decode_header(entry[1]), self.device)]
                return True
        return False

    def take(self, key: Key) -> torch.Tensor:
        """Wait for the tensor `key` names and post the next receive."""
        (kind, mb, stage), i = key, self.index[key]
        with doing(f"recv {kind}{mb} for stage {stage} from rank {self.src}", peer=self.src):
            while self.frontier <= i:
                if not self._post() and not self._resolve_header():
                    raise RuntimeError(f"cannot post the receive of {key} from rank {self.src}: its shape is unknown")
            if self.posted[i][0] == "header":
                self._resolve_header()  # at most one header is posted at a time: this one
            _, buffer, works = self.posted.pop(i)
            wait(works)
            self._post()
            return buffer


def wait(works: list) -> None:
    """Wait for every work of a transfer."""
    for work in works:
        work.wait()
