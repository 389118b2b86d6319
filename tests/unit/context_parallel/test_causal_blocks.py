"""The mask-free causal chunk (`context_parallel.causal_blocks`) against SDPA with the mask it leaves out."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from rewrite.context_parallel.attention import sequence_shard
from rewrite.context_parallel.causal_blocks import causal_chunk_attention, runs_unmasked


def _inputs(dtype=torch.float64, seq=24, heads=8, kv=4):
    torch.manual_seed(0)
    # Laid out as the attention gets them: the sequence permuted in, so slices of it are strided views.
    q = torch.randn(seq, 2, heads, 8, dtype=dtype).permute(1, 2, 0, 3)
    k, v = (torch.randn(seq, 2, kv, 8, dtype=dtype).permute(1, 2, 0, 3) for _ in range(2))
    return [t.detach().requires_grad_() for t in (q, k, v)]


def _grads(out, inputs, seed=1):
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("start", [0, 4, 16])
def test_a_chunk_equals_sdpa_under_the_causal_mask(start):
    q, k, v = _inputs()
    length = 8
    chunk = q[:, :, start:start + length]
    got = causal_chunk_attention(chunk, k, v, start, scale=0.3)
    rows = torch.arange(start, start + length)[:, None]
    allowed = torch.arange(k.shape[2])[None, :] <= rows  # every key up to the query's own position
    want = F.scaled_dot_product_attention(chunk, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
    assert (got - want).abs().max() < 1e-12
    got_grads = _grads(got, (q, k, v))
    for a, b in zip(got_grads, _grads(want, (q, k, v))):
        assert (a - b).abs().max() < 1e-12
    # The keys past the chunk are never read: their gradients are exactly 0.
    assert not got_grads[1][:, :, start + length:].any()


def test_float32_and_bfloat16_within_their_precision():
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, k, v = _inputs(dtype)
        got = causal_chunk_attention(q[:, :, 12:18], k, v, 12)
        allowed = torch.arange(24)[None, :] <= torch.arange(12, 18)[:, None]
        want = F.scaled_dot_product_attention(q[:, :, 12:18].float(), k.float(), v.float(), attn_mask=allowed,
                                              enable_gqa=True)
        assert got.dtype == dtype and (got.float() - want).abs().max() < tol


def test_which_shards_and_devices_run_unmasked():
    q = torch.zeros(1, 2, 4, 8)
    assert runs_unmasked(q, 0.0) and not runs_unmasked(q, 0.1)  # dropout: the masked kernels
    assert not runs_unmasked(q.to("meta"), 0.0)  # other devices: the masked kernels
    plain = sequence_shard(None, 2, 0, 16, device="cpu")
    assert plain.unmasked(None) and plain.unmasked(16) and not plain.unmasked(15)  # a window cutting in: masks
    packed = sequence_shard(None, 2, 0, 16, device="cpu", position_ids=torch.tensor([[*range(8), *range(8)]]))
    assert not packed.unmasked(None)  # documents: masks
