"""The shape of multi-head latent attention (DeepSeek-V2/V3's MLA) from a config, and its FLOPs.

Hidden states go down to a kv latent of `kv_lora_rank` (plus the `qk_rope_head_dim` rotary key every
head shares) and, with `q_lora_rank`, a query latent; each is normalized and projected up to the heads
(queries and keys of `qk_nope_head_dim + qk_rope_head_dim`, values of `v_head_dim`). Under tp the
up-projections, scores and o_proj split with the heads; the down-projections run whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LatentShape", "latent_shape", "latent_flop_parts", "latent_attention_bytes"]


@dataclass(frozen=True)
class LatentShape:
    q_lora: int  # 0: the queries projected straight from the hidden states (DeepSeek-V2-Lite)
    kv_lora: int
    nope: int  # each head's key / query features without rotary
    rope: int  # the rotary features, one key for every head
    v: int  # each head's value features

    @property
    def qk(self) -> int:
        return self.nope + self.rope


def _size(config, name: str) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and value > 0 else 0


def latent_shape(config) -> LatentShape | None:
    """The config's latent attention shape; None when its attention is not latent (no kv_lora_rank)."""
    kv, rope = _size(config, "kv_lora_rank"), _size(config, "qk_rope_head_dim")
    nope, v = _size(config, "qk_nope_head_dim"), _size(config, "v_head_dim")
    if not (kv and rope and nope and v):
        return None
    return LatentShape(_size(config, "q_lora_rank"), kv, nope, rope, v)


def latent_flop_parts(shape: LatentShape, *, hidden: int, heads: int, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of one latent attention over `seq_len` tokens, by part (a multiply-add counts 2):
    q_o (the query up-projection, or q_proj, and o_proj), k_v (kv_b_proj), scores (q k and the weighted sum
    of values), split with the heads; latent (the down-projections), whole on every rank."""
    h, a, s, z = hidden, heads, seq_len, shape
    return {
        "q_o": 2 * s * (z.q_lora or h) * a * z.qk + 2 * s * a * z.v * h,
        "k_v": 2 * s * z.kv_lora * a * (z.nope + z.v),
        "scores": 2 * s * s * a * (z.qk + z.v),
        "latent": 2 * s * h * (z.q_lora + z.kv_lora + z.rope),
    }


def latent_attention_bytes(shape: LatentShape, *, tokens: int, kv_tokens: int, heads: int, dtype_bytes: int,
                           tp: int = 1) -> int:
    """Bytes one latent attention keeps for its backward beyond its input, on one rank (`tp`: the heads'
    split; 1 when whole): each latent's norm (its float32 input, the normalised values, 1 / rms) and the
    up-projection's input, whole on every rank; then per head the queries and keys after RoPE (`qk`
    features), kv_b_proj's output (the values are a view of it: `nope + v`, the keys' whole sequence under
    cp), SDPA's output and the copy o_proj reads (`v`), and SDPA's float32 logsumexp. Measured on tiny
    DeepSeek-V3 in float32 (CPU SDPA): within 2 % (float32 keeps the rotary key in the kv latent's storage)."""
    z, T, B, a = shape, tokens, dtype_bytes, heads
    latents = [r for r in (z.q_lora, z.kv_lora) if r]
    whole = sum(T * (4 * r + 2 * B * r + 4) for r in latents)
    per_head = T * (B * a * z.qk + 2 * B * a * z.v + 4 * a) + kv_tokens * B * a * (z.qk + z.nope + z.v)
    return whole + per_head // tp
