"""Point-to-point transfers between pipeline stages (torch.distributed isend/irecv).

When a receiver knows the shape (Hugging Face stages: `[mb, seq, hidden]`) only
the tensor travels. Otherwise a small int64 header with the dtype and shape goes
first, so stages of arbitrary traced modules need no shape declarations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["send", "recv", "send_header", "decode_header", "HEADER_SHAPE"]

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_MAX_DIMS = 8
HEADER_SHAPE = (2 + _MAX_DIMS,)  # ndim, dtype code, then the sizes, padded with -1


def send(tensor: torch.Tensor, dst: int) -> list[dist.Work]:
    """Start sending `tensor` to global rank `dst`; keep `tensor` alive until the works finish."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, dst)])


def recv(
    src: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[dist.Work]]:
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
    values = header.tolist()
    ndim, code = values[0], values[1]
    return tuple(values[2 : 2 + ndim]), _DTYPES[code]
