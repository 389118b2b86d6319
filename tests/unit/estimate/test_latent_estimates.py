"""The estimates of multi-head latent attention (DeepSeek's MLA), against what autograd keeps for a tiny
DeepSeek-V3's attention in float32, whole and as one tp rank's heads (the latents whole on each rank), with
and without a query latent; its FLOPs by hand."""

from __future__ import annotations

import pytest
import torch

from rewrite.estimate.activations import Sizes, layer_bytes
from rewrite.models.flops import LatentShape, latent_shape, layer_flop_parts
from tests.families import tiny_moe_model
from tests.saved_bytes import saved_bytes

B, S = 2, 64


def _attention_bytes(model) -> int:
    """Bytes of the storages autograd saves in layer 0's attention on B x S tokens (weights, cos and sin out)."""
    attention = model.model.layers[0].self_attn
    x = torch.randn(B, S, model.config.hidden_size, requires_grad=True)
    rotary = model.model.rotary_emb(x, torch.arange(S)[None].expand(B, -1))
    return saved_bytes(lambda: attention(x, position_embeddings=rotary, attention_mask=None),
                       [*model.parameters(), *rotary])


def _estimated(config, tp: int) -> int:
    """The estimate's attention bytes: the layer's with a dense MLP of width 0 and its two norms taken off."""
    z = Sizes.of(config, seq_len=S, batch_size=B, tp=tp)
    bare = Sizes(**{**z.__dict__, "top_k": 0, "intermediate": 0})
    return layer_bytes(bare, mlp_split=False)[0] - 2 * B * S * (8 * 64 + 4) - B * S * 4 * 64


@pytest.mark.parametrize("query_latent", [True, False])
def test_latent_attention_keeps_what_the_estimate_says(query_latent):
    over = {} if query_latent else {"q_lora_rank": None}
    model = tiny_moe_model("deepseek_v3", **over)
    assert latent_shape(model.config) == LatentShape(384 if query_latent else 0, 128, 32, 16, 32)
    measured, estimated = _attention_bytes(model), _estimated(model.config, 1)
    assert abs(estimated / measured - 1) < 0.02, (estimated, measured)
    # One rank of tp 2: half the heads (a tiny model of 2), the latents whole.
    half = _attention_bytes(tiny_moe_model("deepseek_v3", num_attention_heads=2, num_key_value_heads=2, **over))
    assert abs(_estimated(model.config, 2) / half - 1) < 0.02, (_estimated(model.config, 2), half)


def test_latent_attention_flops():
    config = tiny_moe_model("deepseek_v3").config  # h 64, 4 heads, q latent 384, kv latent 128 + rope 16
    parts = layer_flop_parts(config, seq_len=S)
    assert parts["q_o"] == 2 * S * 384 * 4 * 48 + 2 * S * 4 * 32 * 64
    assert parts["k_v"] == 2 * S * 128 * 4 * (32 + 32)
    assert parts["scores"] == 2 * S * S * 4 * (48 + 32)
    assert parts["latent"] == 2 * S * 64 * (384 + 128 + 16)
