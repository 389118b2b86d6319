"""Estimated compute of a LLaMA-family model's parts, from its config alone.

Counted in FLOPs for one sequence of `seq_len` tokens; only the ratios matter: they
choose `cut_points: auto` (`binding.cuts.best_split`) and give the shares `rewrite show` prints.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .hf_decoder import Backbone

__all__ = ["Costs", "config_size", "estimate_costs", "layer_flops", "layer_flop_parts", "head_flops", "embed_flops",
           "LatentShape", "latent_shape", "latent_flop_parts", "moe_shape", "moe_width", "TRAINING"]

# The backward computes two products for each forward one (input and weight gradients).
TRAINING = 3
# RMSNorm, per value: square, mean, scale by the reciprocal root, scale by the weight.
NORM_FLOPS = 4
# Log-softmax and the loss, per logit: max, subtract, exp, sum, log.
LOSS_FLOPS = 5


@dataclass(frozen=True)
class Costs:
    """Training FLOPs (forward + backward) of one sequence, per part, on one rank of a stage."""

    seq_len: int
    embed: int  # on the first stage
    layers: tuple[int, ...]  # one per decoder layer
    head: int  # final norm, LM head and loss, on the last stage

    def stage_costs(self, sizes: Sequence[int]) -> list[int]:
        """Cost of each stage when stage s holds the next `sizes[s]` layers."""
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        out = [sum(self.layers[a : a + k]) for a, k in zip(starts, sizes)]
        out[0] += self.embed
        out[-1] += self.head
        return out

    def shares(self, sizes: Sequence[int]) -> list[float]:
        """Each stage's fraction of the whole step's estimated compute."""
        costs = self.stage_costs(sizes)
        return [c / sum(costs) for c in costs]

    def folded(self) -> list[int]:
        """Per layer, the embeddings added to the first and the head to the last (stage 0 always holds
        layer 0 and the last stage the last layer, so splitting these weights is splitting the model)."""
        return self.stage_costs([1] * len(self.layers))


def config_size(config, name: str, *, purpose: str = "the compute estimate") -> int:
    """`config.<name>`, which `purpose` needs as a positive integer (ValueError otherwise)."""
    value = _one_size(config, name)
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"config.{name} is {value!r}; {purpose} needs a positive integer "
            f"({type(config).__name__} is not shaped like a LLaMA-family config)"
        )
    return value


def _one_size(config, name: str):
    """`config.<name>` (None when absent); ValueError when the config keeps it per layer (Gemma-4's head_dim)."""
    try:
        return getattr(config, name, None)
    except Exception as exc:  # transformers' per-layer attribute read globally
        raise ValueError(f"{type(config).__name__} keeps {name} per layer: the compute estimate counts layers of "
                         "one size") from exc


def layer_flop_parts(config, *, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of one decoder layer over `seq_len` tokens, by part (a multiply-add counts 2).

    With h = hidden_size, a / kv = query / key-value heads of size d, i = intermediate_size,
    s = seq_len:
        q_o     q and o projections        2 s h d (2 a)
        k_v     k and v projections        2 s h d (2 kv)     (GQA: k and v have kv heads)
        scores  scores and weighted sum    4 s s a d          (dense s x s, as the eager and masked
                                                               SDPA kernels compute it)
        mlp     MLP gate, up, down         6 s h i
        norms   two RMSNorms               2 * NORM_FLOPS s h
    A mixture of experts (`moe_width`): i is the width a token runs through, k experts of width
    i_e plus the shared ones, and the router adds 2 s h E. Multi-head latent attention
    (`latent_shape`) has its own q_o, k_v and scores and a `latent` part (the down-projections,
    whole under tp): `latent_flop_parts`. Elementwise work (RoPE, SiLU, residuals, the score
    softmax) is left out: ~1% here.
    """
    h, a = config_size(config, "hidden_size"), config_size(config, "num_attention_heads")
    moe = moe_width(config)
    i = config_size(config, "intermediate_size") if moe is None else moe[0]
    kv = _one_size(config, "num_key_value_heads") or a
    d = _one_size(config, "head_dim") or h // a  # Mistral's config may hold head_dim=None
    s = seq_len
    router = 0 if moe is None else 2 * s * h * moe[1]
    latent = latent_shape(config)
    attention = ({"q_o": 2 * s * h * d * 2 * a, "k_v": 2 * s * h * d * 2 * kv, "scores": 4 * s * s * a * d}
                 if latent is None else latent_flop_parts(latent, hidden=h, heads=a, seq_len=s))
    return {**attention, "mlp": 6 * s * h * i + router, "norms": 2 * NORM_FLOPS * s * h}


# Multi-head latent attention (DeepSeek-V2/V3's MLA): hidden states go down to a kv latent of `kv_lora_rank`
# (plus the `qk_rope_head_dim` rotary key every head shares) and, with `q_lora_rank`, a query latent; each is
# normalized and projected up to the heads (queries and keys of `qk_nope_head_dim + qk_rope_head_dim`, values
# of `v_head_dim`). Under tp the up-projections, scores and o_proj split with the heads; the down-projections
# run whole on every rank.
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


def latent_shape(config) -> LatentShape | None:
    """The config's latent attention shape; None when its attention is not latent (no kv_lora_rank)."""
    kv, rope = _first(config, "kv_lora_rank"), _first(config, "qk_rope_head_dim")
    nope, v = _first(config, "qk_nope_head_dim"), _first(config, "v_head_dim")
    if not (kv and rope and nope and v):
        return None
    return LatentShape(_first(config, "q_lora_rank") or 0, kv, nope, rope, v)


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


def _first(config, *names: str) -> int | None:
    return next((v for n in names if isinstance(v := getattr(config, n, None), int) and v > 0), None)


def moe_shape(config) -> tuple[int, int, int, int] | None:
    """(k, an expert's width, the shared experts' width, the experts a router scores) of a mixture of
    experts' config; None for a dense one. A token runs through its k chosen experts
    (`num_experts_per_tok`, ...) of width `moe_intermediate_size` (else `intermediate_size`) and the
    shared experts, every layer taken as sparse (a family's few dense layers are not counted apart)."""
    if getattr(config, "is_moe", True) is False:  # Doge's config counts experts it does not use
        return None
    experts = _first(config, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    top_k = _first(config, "num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token")
    if experts is None or top_k is None:
        return None
    width = _first(config, "moe_intermediate_size", "expert_ffn_hidden_size", "intermediate_size")
    if width is None:
        return None
    shared = _first(config, "shared_expert_intermediate_size") or width * (
        _first(config, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts") or 0)
    return top_k, width, shared, experts


def moe_width(config) -> tuple[int, int] | None:
    """(the MLP width a token runs through: k experts and the shared ones, the experts a router scores) of a
    mixture of experts' config (`moe_shape`); None for a dense one."""
    shape = moe_shape(config)
    return None if shape is None else (shape[0] * shape[1] + shape[2], shape[3])


def layer_flops(config, *, seq_len: int) -> int:
    """Forward FLOPs of one decoder layer over `seq_len` tokens: the sum of `layer_flop_parts`."""
    return sum(layer_flop_parts(config, seq_len=seq_len).values())


def head_flops(config, *, seq_len: int, has_head: bool = True) -> int:
    """Forward FLOPs of the final norm, then (with a head) the LM head's 2 s h V and the loss's
    LOSS_FLOPS s V over V = vocab_size."""
    h, s = config_size(config, "hidden_size"), seq_len
    norm = NORM_FLOPS * s * h
    if not has_head:
        return norm
    vocab = config_size(config, "vocab_size")
    return norm + 2 * s * h * vocab + LOSS_FLOPS * s * vocab


def embed_flops(config, *, seq_len: int) -> int:
    """The embedding lookup: one operation per value gathered, s h (its backward scatter-adds as many)."""
    return seq_len * config_size(config, "hidden_size")


def estimate_costs(
    config,
    backbone: Backbone,
    *,
    num_layers: int,
    seq_len: int,
    tp: int = 1,
    sharded: Collection[str] = (),
) -> Costs:
    """Training FLOPs per part of a LLaMA-family model, as one rank of its stage runs them: a part whose
    linears the plan shards (`sharded`: module paths) is divided by `tp`.

    Raises:
        ValueError: the config lacks a size the estimate needs (named in the message).

    Example:
        >>> costs = estimate_costs(config, find_backbone(model), num_layers=32, seq_len=2048)
        >>> costs.head > costs.layers[0]  # a 128k vocabulary
        True
    """

    def split(flops: int, prefix: str | None) -> int:
        hit = prefix is not None and any(f == prefix or f.startswith(prefix + ".") for f in sharded)
        return TRAINING * flops // (tp if hit else 1)

    layer = layer_flops(config, seq_len=seq_len)
    return Costs(
        seq_len=seq_len,
        embed=split(embed_flops(config, seq_len=seq_len), backbone.embed),
        layers=tuple(split(layer, backbone.layer(i)) for i in range(num_layers)),
        head=split(head_flops(config, seq_len=seq_len, has_head=backbone.has_head), backbone.head),
    )
