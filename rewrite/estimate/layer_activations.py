"""The bytes one microbatch keeps alive for its backward in one decoder layer and at the last stage's end.

Megatron's accounting (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022: about s b h (34 + 5 a s / h) bytes per layer in fp16) adapted to
what Hugging Face LLaMA-family layers save with SDPA attention. Pure arithmetic on the config
and the resolved plan; a meta-device model will do.

Notation: s = pipeline.seq_len, b = sequences per microbatch (1 unless given), h = hidden_size,
a / g = query / key-value heads of size d, i = intermediate_size, V = vocab_size, t = mesh.tp,
B = bytes per element of the compute dtype, c = mesh.cp. Tokens a rank holds: T = b s / c (context
parallelism splits the sequence). Under sequence_parallel a rank holds C = b ceil(s / (c t)) tokens
between the blocks and the MLP runs on R = b t ceil(s / (c t)) rows (the padding rows too); without
it C = R = T. A block whose first linear is split
('column') divides its inner activations by t' = t, an unsplit one by t' = 1; r = tp ranks
holding each kv head of a split attention (t / g when t passes g, else 1; unsplit: 1).

Bytes one decoder layer keeps for its backward:

    each RMSNorm (2)  C (4 h + B h + 4)    its input upcast to float32, the normalised values,
                                           and 1 / rms (float32) per token
    attention         T B h                its input, read by q/k/v (under sequence_parallel the
                                           all-gathered input: the column layers keep it whole)
                    + T (B a d + 2 B a d + 4 a) / t' + b s B 2 g r d / t'
                                           q after RoPE, SDPA's output and its copy read by o_proj,
                                           SDPA's float32 logsumexp (the flash and memory-efficient
                                           kernels keep no s x s matrix); k after RoPE and v, the
                                           whole sequence's (GQA keeps g r / t' heads a rank; under
                                           cp the gathered keys and values, c T tokens)
                    + T ((4 + B) (a + g r) d + 4 (a + g r)) / t'   with per-head q_norm / k_norm (Qwen3)
    latent attention  T B h + sum over the latents r_q, r_kv of T (4 r + 2 B r + 4)   (DeepSeek's MLA:
                    + (T (B a d_qk + 2 B a d_v + 4 a) + b s B a (d_qk + d_nope + d_v)) / t'
                                           `latent_attention_bytes`)
    MLP               R B h + 4 R B i / t'  its input; gate, SiLU(gate), up and their product
    mixture of experts (k of E experts of width i_e a token, shared experts of width i_s, transformers'
    grouped_mm experts; `models.flops.moe_shape`)
                      R B h + R (k (n B i_e / t_e + 2 B h + 36) + 16) / u + 4 R_s B i_s / t_s
                                           its input; per (token, choice): the row sent to the expert,
                                           its gate/up, activation and product (n = 4; gpt-oss's
                                           clamped, sigmoid-gated ones 7: `EXPERT_VALUES`),
                                           the expert's output before the routing weight, an int64
                                           index and float32 weights (36, and 16 a token: measured in
                                           float32); t_e: tp when each expert is split over tp
                                           (`expert_tensor_parallel`), else 1. At balanced routing a
                                           rank under ep runs as many rows as it sends: u = 1, or
                                           t when ep borrows tp ranks, each taking 1/t of the
                                           tokens (ep's exchange buffers are not counted). Under
                                           sequence parallelism, experts not split over tp: R = C,
                                           the block running on the rank's part. t_s: tp when the
                                           shared experts are split over tp, else 1; R_s = R, or
                                           under sequence parallelism with t_s = t the gathered
                                           rows t C, whose input (t C B h) they keep besides; a
                                           gated shared expert (Qwen2-MoE) keeps B (h + 1) a token more
                                           (not counted: ~8 % of its MLP at hidden 64)

Residual adds keep nothing and LLaMA has no dropout. For LLaMA-7B shapes in bfloat16
(B = 2, g = a, i ~ 2.7 h) that is about 48 s b h bytes per layer, no s^2 term, against
Megatron's 34 s b h + 5 a s^2 b for GPT (GeLU MLP, dropout masks, eager attention).

A module matched by activation_checkpointing (a decoder layer, or its input_layernorm,
self_attn, post_attention_layernorm or mlp) keeps only its input, B h per token: C tokens
(the model's first layer under sequence_parallel keeps T: it splits its own input). While
its backward runs, its forward runs again and holds its full activations: the largest
recomputed module of a rank counts once, not per microbatch. Checkpointed 'selective', it
keeps besides every other matrix product's output from the first of its call, and the
attention kernel's output and float32 log-sum-exp. A layer calls q, k, v, o, gate, up, down:

    products          T B a d / t', T B g r d / t' (twice), T B h        q, k, v; o's partial sums
                      R B i / tm (twice), R B h                          gate, up; down's partial sums
    kept              q, v, gate, down (the 1st, 3rd, 5th, 7th) + T (B a d + 4 a) / t'
    a part alone      its own products counted from its first: self_attn q and v, mlp gate and down

(estimated for layers of exactly these projections, without context parallelism: `selective_problem`).

Under cp each stage also keeps, per microbatch, the additive masks of its rank's two query chunks
(`context_parallel.attention`: one tensor per chunk shared by the layers): chunks of L = s / (2 c)
queries against (2 c + 1) L keys together, B (2 c + 1) L^2 bytes (b times with packed documents;
a sliding window's are counted whole).

The last stage adds the final norm, C (4 h + B h + 4); the LM head's input, T B h; and the
loss: without loss_parallel F.cross_entropy keeps float32 log-probabilities of the whole
vocabulary, 4 T V, on every tp rank; with it, the vocabulary-parallel cross-entropy keeps the
rank's logit shard and a float32 logsumexp, T (B V / t + 4). The embedding keeps only the
token ids: its output is the first layer's input, counted there. A stage that is not the last
holds its output, B h per token (C under sequence_parallel), until the backward.

"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from ..models.blocks import ATTENTION, LAYER_PARTS, MLP, PACKED_MLP
from ..models.flops import LatentShape, config_size, latent_shape, moe_shape
from .lora_costs import lora_bytes

__all__ = ["Sizes", "layer_bytes", "norm_bytes", "SELECTIVE", "selective_products", "latent_attention_bytes"]

# Values an expert keeps for its backward per routed row and intermediate feature: its gate/up output,
# the activation and the product (4); gpt-oss clamps gate and up and gates with a scaled sigmoid (7).
EXPERT_VALUES = {"gpt_oss": 7}

F32 = 4  # bytes of a float32: norms upcast their input, SDPA's logsumexp, the plain loss
SELECTIVE = "~"  # marks a part checkpointed 'selective' in `layer_bytes`' recomputed ("~" alone: the whole layer)
_ATTENTION, _MLP = LAYER_PARTS[1], LAYER_PARTS[3]


@dataclass(frozen=True)
class Sizes:
    """What the estimate reads: the model's sizes and the run's."""

    hidden: int  # h
    heads: int  # a
    kv_heads: int  # g
    head_dim: int  # d
    intermediate: int  # i
    vocab: int  # V
    seq_len: int  # s
    batch_size: int = 1  # b, sequences per microbatch
    tp: int = 1  # t
    dtype_bytes: int = 4  # B
    sequence_parallel: bool = False
    qk_norm: bool = False  # per-head q_norm / k_norm (Qwen3)
    kv_replicas: int = 1  # r: tp ranks holding each kv head when the attention is split
    cp: int = 1  # c: context-parallel ranks, each holding s / c tokens of every sequence
    top_k: int = 0  # k: experts a token runs through (0: a dense MLP)
    expert_width: int = 0  # i_e
    shared_width: int = 0  # i_s: the shared experts together
    expert_values: int = 4  # n: values an expert keeps per routed row and intermediate feature
    routed_split: int = 1  # u: ranks sharing out a replica's tokens before their experts (ep borrowing tp: t)
    latent: LatentShape | None = None  # multi-head latent attention's shape (DeepSeek's MLA), else None
    lora_rank: int = 0  # r_l: LoRA adapters' rank (0: every weight trained, no adapters)
    lora_leaves: frozenset[str] = frozenset()  # the projections (by name) in each layer that carry one
    lora_dropout: bool = False  # the adapters drop their input: a dropped copy and its mask kept per adapter

    @classmethod
    def of(cls, config, *, seq_len: int, **run) -> Sizes:
        """From a transformers config; `run` sets the fields after seq_len (batch_size, tp, ...)."""
        h, a, i, v = (config_size(config, name, purpose="the activation estimate")
                      for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"))
        k, width, shared, _ = moe_shape(config) or (0, 0, 0, 0)
        return cls(
            hidden=h, heads=a, kv_heads=getattr(config, "num_key_value_heads", None) or a,
            head_dim=getattr(config, "head_dim", None) or h // a,  # Mistral's config may hold None
            intermediate=i, vocab=v, seq_len=seq_len, top_k=k, expert_width=width, shared_width=shared,
            expert_values=EXPERT_VALUES.get(getattr(config, "model_type", None), 4),
            latent=latent_shape(config), **run,
        )

    @property
    def tokens(self) -> int:
        """T = b s / c: the tokens of the sequence a rank holds (all of them without context parallelism)."""
        return self.batch_size * (self.seq_len // self.cp)

    @property
    def chunk(self) -> int:
        """C: the tokens a rank holds between the blocks (b ceil(s / (c t)) under sequence parallelism)."""
        return self.batch_size * math.ceil(self.seq_len // self.cp / self.tp) if self.split_sequence else self.tokens

    @property
    def mask_bytes(self) -> int:
        """Under cp, the additive masks of a rank's two query chunks: B (2 c + 1) L^2, L = s / (2 c); else 0."""
        if self.cp == 1:
            return 0
        chunk = self.seq_len // (2 * self.cp)
        return self.dtype_bytes * (2 * self.cp + 1) * chunk * chunk

    @property
    def mlp_rows(self) -> int:
        """R: rows the MLP runs on; under sequence parallelism the gathered chunks, padding included."""
        return self.tp * self.chunk if self.split_sequence else self.tokens

    @property
    def split_sequence(self) -> bool:
        return self.sequence_parallel and self.tp > 1


def norm_bytes(z: Sizes, tokens: int) -> int:
    """What an RMS norm over `tokens` keeps: its float32 input, the normalised values in the dtype (for the
    weight's gradient: none when frozen, under LoRA) and a float32 1/rms per token."""
    return tokens * (F32 * z.hidden + (0 if z.lora_rank else z.dtype_bytes * z.hidden) + F32)


def _parts(z: Sizes, *, attention_split: bool, mlp_split: bool, shared_split: bool = False) -> dict[str, int]:
    """Bytes each part of one decoder layer keeps, not checkpointed."""
    B, h, d, a = z.dtype_bytes, z.hidden, z.head_dim, z.heads
    ta, tm, T, R = (z.tp if attention_split else 1), (z.tp if mlp_split else 1), z.tokens, z.mlp_rows
    g = z.kv_heads * (z.kv_replicas if attention_split else 1)  # g r: a rank holds g r / t' kv heads
    kv_tokens = z.batch_size * z.seq_len  # SDPA keeps the whole sequence's keys and values (gathered under cp)
    attention = T * B * h + (T * (B * a * d + 2 * B * a * d + F32 * a) + kv_tokens * B * 2 * g * d) // ta
    if z.latent is not None:
        attention = T * B * h + latent_attention_bytes(z.latent, tokens=T, kv_tokens=kv_tokens, heads=a,
                                                       dtype_bytes=B, tp=ta)
    if z.qk_norm:
        attention += T * ((F32 + (0 if z.lora_rank else B)) * (a + g) * d + F32 * (a + g)) // ta  # frozen: no B
    mlp = _moe(z, tm, z.tp if shared_split else 1) if z.top_k else R * B * h + 4 * R * B * z.intermediate // tm
    if z.lora_rank:
        attention += lora_bytes(z, ATTENTION.inputs, ATTENTION.output, a * d // ta)
        mlp += 0 if z.top_k else lora_bytes(z, (*MLP.inputs, *PACKED_MLP.inputs), MLP.output, z.intermediate // tm)
    return dict(zip(LAYER_PARTS, (norm_bytes(z, z.chunk), attention, norm_bytes(z, z.chunk), mlp)))


def _moe(z: Sizes, tm: int, ts: int) -> int:
    """Bytes a mixture of experts' block keeps (the module docstring's); under sequence parallelism, with
    its experts not split over tp (tm = 1), it runs on the rank's part of the sequence (C rows), and shared
    experts split over tp (ts = t) gather every part's rows, which they keep besides."""
    B, R = z.dtype_bytes, (z.chunk if z.split_sequence and tm == 1 else z.mlp_rows)
    rows = z.mlp_rows if z.split_sequence and ts > 1 else R
    gathered = rows * B * z.hidden if rows != R else 0
    return R * B * z.hidden + R * _routed(z, tm) // z.routed_split + 4 * rows * B * z.shared_width // ts + gathered


def _routed(z: Sizes, tm: int = 1) -> int:
    """Bytes a token's k routed experts keep (the module docstring's mixture of experts); each expert split
    over `tm` ranks (`expert_tensor_parallel`) keeps 1/tm of its features, its rows whole."""
    B = z.dtype_bytes
    return z.top_k * (z.expert_values * B * z.expert_width // tm + 2 * B * z.hidden + 36) + 16


def selective_products(z: Sizes, parts: Collection[str], *, attention_split: bool = True, mlp_split: bool = True
                       ) -> tuple[int, float]:
    """(bytes kept, share of the forward's projection FLOPs run again) of `parts` of a layer checkpointed
    'selective': every other product from the first of the call, and the attention kernel's output."""
    B, h, d, a, i = z.dtype_bytes, z.hidden, z.head_dim, z.heads, z.intermediate
    ta, tm, T, R = (z.tp if attention_split else 1), (z.tp if mlp_split else 1), z.tokens, z.mlp_rows
    g = z.kv_heads * (z.kv_replicas if attention_split else 1)
    products, flops = [], []  # bytes and FLOPs of each product, in the order the layer calls them
    if _ATTENTION in parts:
        for width in (a * d, g * d, g * d):  # q, k, v
            products.append(T * B * width // ta)
            flops.append(T * h * width / ta)
        products.append(T * B * h)  # o's partial sums (under tp), before they are summed
        flops.append(T * a * d * h / ta)
    if _MLP in parts:
        products += [R * B * i // tm] * 2 + [R * B * h]  # gate, up; down's partial sums
        flops += [R * h * i / tm] * 3
    kept = sum(products[0::2]) + (T * (B * a * d + F32 * a) // ta if _ATTENTION in parts else 0)
    return kept, sum(flops[1::2]) / sum(flops) if flops else 0.0


def layer_bytes(
    z: Sizes, *, attention_split: bool = True, mlp_split: bool = True, shared_split: bool | None = None,
    first: bool = False, recomputed: Collection[str] = (),
) -> tuple[int, int]:
    """One decoder layer's activations for one microbatch: (bytes kept until its backward,
    bytes its recomputed forward holds again during the backward).

    Args:
        z: the sizes.
        attention_split, mlp_split: the block's linears are split over tp (t' = t).
        shared_split: a mixture of experts' shared experts are split over tp (t_s = t); None: as the MLP.
        first: the model's first layer (under sequence parallelism its input is whole).
        recomputed: "" for the whole layer, or names in `models.blocks.LAYER_PARTS`, checkpointed;
            each prefixed `SELECTIVE` where checkpointed 'selective'.

    Example:
        >>> z = Sizes(hidden=64, heads=8, kv_heads=4, head_dim=8, intermediate=128, vocab=256, seq_len=16)
        >>> layer_bytes(z), layer_bytes(z, recomputed=[""]), layer_bytes(z, recomputed=["~"])
        ((74368, 0), (4096, 74368), (27136, 74368))
    """
    shared = mlp_split if shared_split is None else shared_split
    parts = _parts(z, attention_split=attention_split, mlp_split=mlp_split, shared_split=shared)
    splits = {"attention_split": attention_split, "mlp_split": mlp_split}
    # A checkpointed module keeps its input: the layer's (whole for the first under sequence
    # parallelism), or a part's, which under sequence parallelism is a rank's chunk.
    layer_input = (z.tokens if first else z.chunk) * z.dtype_bytes * z.hidden
    whole = {name.removeprefix(SELECTIVE) for name in recomputed} & {""}
    if whole:
        kept = selective_products(z, LAYER_PARTS, **splits)[0] if SELECTIVE in recomputed else 0
        return layer_input + kept, sum(parts.values())
    kept = 0
    for name, size in parts.items():
        if name in recomputed:
            kept += z.chunk * z.dtype_bytes * z.hidden
        elif SELECTIVE + name in recomputed:
            kept += z.chunk * z.dtype_bytes * z.hidden + selective_products(z, [name], **splits)[0]
        else:
            kept += size
    return kept, max((parts[n.removeprefix(SELECTIVE)] for n in recomputed if n.removeprefix(SELECTIVE) in parts),
                     default=0)



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
