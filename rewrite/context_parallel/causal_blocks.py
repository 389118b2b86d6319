"""A query chunk's causal attention without a mask: the keys before the chunk unmasked, the chunk's own
diagonal block causal, the two merged by their log-sum-exp.

Under the plain causal mask a chunk of global queries [a, a + L) sees every key before a and the causal
triangle of [a, a + L): the prefix block with no mask, the diagonal block with the kernel's own causal
flag (a square block, so its top-left alignment is the right one). Their outputs o1, o2 and
log-sum-exps l1, l2 merge into the chunk's softmax over both:

    l = log(exp(l1) + exp(l2)),   o = exp(l1 - l) o1 + exp(l2 - l) o2

The backward hands each block's kernel the merged o and l (what flash attention's backward reads to
rebuild a block's probabilities and the row sums of dO o), so each block's gradients are its part
of the chunk's one softmax, as in ring attention. No mask is built, read or saved.

The kernels are CPU's flash attention (`aten._scaled_dot_product_flash_attention_for_cpu` and its
backward): they return the log-sum-exp and take grouped keys and values as they are.
"""

from __future__ import annotations

import torch

__all__ = ["causal_chunk_attention", "runs_unmasked"]

_aten = torch.ops.aten


def runs_unmasked(query: torch.Tensor, dropout: float) -> bool:
    """Whether the chunks of `query` take the mask-free path: CPU's flash kernels, without dropout."""
    return query.device.type == "cpu" and dropout == 0.0


class _CausalChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, start: int, scale):
        # query [b, h, L, d] at global positions [start, start + L); key and value [b, g, >= start + L, d].
        end = start + query.shape[2]
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            query, key[:, :, start:end], value[:, :, start:end], 0.0, True, scale=scale)
        if start:
            before, before_lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                query, key[:, :, :start], value[:, :, :start], 0.0, False, scale=scale)
            merged = torch.logaddexp(lse, before_lse)  # float32 (the kernels' log-sum-exp), and so the weights
            out = (out * (lse - merged).exp().unsqueeze(-1) + before * (before_lse - merged).exp().unsqueeze(-1)
                   ).to(query.dtype)
            lse = merged
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.start, ctx.scale = start, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        start, scale = ctx.start, ctx.scale
        end = start + query.shape[2]
        grad = grad.contiguous()
        d_query, d_key_diag, d_value_diag = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key[:, :, start:end], value[:, :, start:end], out, lse, 0.0, True, scale=scale)
        d_key, d_value = key.new_zeros(key.shape), value.new_zeros(value.shape)
        d_key[:, :, start:end], d_value[:, :, start:end] = d_key_diag, d_value_diag
        if start:
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, query, key[:, :, :start], value[:, :, :start], out, lse, 0.0, False, scale=scale)
            d_query = d_query + dq
            d_key[:, :, :start], d_value[:, :, :start] = dk, dv
        return d_query, d_key, d_value, None, None


def causal_chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int,
                           scale: float | None = None) -> torch.Tensor:
    """Causal attention of a chunk of queries at global positions [start, start + L) against the keys
    and values [0, start + L) (or more: those past the chunk are not read), `[b, heads, L, d]` out."""
    return _CausalChunk.apply(query, key, value, start, scale)
