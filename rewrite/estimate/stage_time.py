"""Per stage and microbatch: how long its forward, input-backward and weight-backward take on one rank.

Compute from FLOPs (`rewrite.models.flops.layer_flop_parts`) at the profile's peak for the
parameters' dtype times its matmul efficiency, plus memory traffic at its bandwidth; then the
tensor-parallel collectives the plan's styles and switches make, over the link the tp group spans.

Per decoder layer over T = b s tokens (a part split over tp divides by t; k/v held by r ranks
each under kv replication divide by t / r):
    F   q_o + k_v + scores + mlp + norms            matmul FLOPs / (peak x matmul efficiency)
    I   q_o + k_v + 2 scores + mlp + 2 norms        the input gradients (attention's are twice its forward)
    W   q_o + k_v + mlp                             the weight gradients
(multi-head latent attention adds its down-projections to q_o + k_v, whole under tp).
Memory traffic, at the bandwidth: F writes and reads back what the layer keeps for its backward
(`activations.layer_bytes`) and reads the weights; I reads it and writes as much again; W reads
and accumulates the gradients (2x the weights). A checkpointed layer adds its forward to its I, and
a stage on a pp rank that recomputes runs its W in its I (`unsplit_stages`).
A layer also costs the profile's fixed `layer_overhead_s` per microbatch (operator dispatch, which
eager CPU runs pay in full), a third in each of F, I and W (one checkpointed 'selective' adds
`selective_overhead_s` to its I: torch's policy on each operator), and each of its eager tp collectives the
profile's `call_overhead_s` of its kind beyond the collective's own time (measured on a tp layer; cp's
gathers and reduce-scatters of keys and values, which go by the same exchanges, a `gather` each).
Collectives per split block (attention, MLP) and microbatch, of T h B bytes:
    plain tp             F: 1 all-reduce (row out)           I: 1 all-reduce (column in)
    sequence parallel    F: all-gather in, reduce-scatter out; I: the same two in reverse
Under context parallelism (c = mesh.cp) a rank holds T = b s / c tokens: the projections, MLP and
norms divide by c, and each rank's two query chunks of L = s / (2 c) score against (2 c + 1) L keys
through a mask, every pair of their range computed. The scores are charged per pair computed as one
process's are: its causal kernel computes the s^2 / 2 pairs under the mask and is charged the dense
s x s, so a rank's (2 c + 1) L^2 pairs are charged (2 c + 1) / (2 c^2) of it (measured on CPU at
4,096 tokens: the cp 2 step at 0.62x one process, this model 0.59x). Each
layer all-gathers the keys and values of the whole sequence over the cp group in F, 2 b s g r d B / t'
bytes, and reduce-scatters their gradients in I (again in a recomputed F); its own work around them (the
profile's measured `context_work`: a fixed part and a part per byte gathered) half in F, half in I.
A layer whose experts are split over ep (e = mesh.ep) exchanges its routed rows in F (the rows' counts per
expert, then T k rows of h + 1 values out, their results back: 3 all-to-alls over the ep group, balanced
routing), and their gradients again in I (2; again 3 in a recomputed F): T k (2 h + 1) B bytes each way per
pass, at the compute dtype (a family whose routing weights stay float32 under bfloat16 sends float32 rows).
Each exchange blocks and costs the profile's `call_overhead_s` beside its own time: `all_to_all_tp` over tp
ranks (beside the tp collectives), `all_to_all` otherwise (missing: `all_to_all`, then a tp `sum`'s),
compiled or not (a compiled block is split at it).
When ep borrows tp ranks each tp rank takes 1/t of the tokens: its routed experts' FLOPs (6 T h k i_e)
and rows divide by t, and the layer all-gathers the chunks' outputs over tp in F (T h B) and their
tokens' and routing weights' gradients in I (T (h + k) B). Shared experts split over tp (a column inside
the MLP's children) divide their FLOPs (6 T h i_s) by t and add a collective of their own, as a split
block does. Under sequence parallelism a MoE block whose experts are not split over tp runs on the rank's
part of the sequence: all its FLOPs and rows divide by t, with no collective of its own but its split
shared experts' gather and scatter.
The first stage adds the embedding (a vocab-split one: an all-reduce of its output); the last
the final norm, LM head and loss: a whole-vocabulary head gathered over tp ('column_gather')
all-gathers T V B of logits, the vocabulary-parallel loss gathers 2 floats per token, and the
split head's input gradient is all-reduced (reduce-scattered under sequence parallelism).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..models.blocks import ATTENTION, LAYER_PARTS, MLP
from ..models.flops import LOSS_FLOPS, NORM_FLOPS, layer_flop_parts
from ..binding.resolve import ResolvedPlan
from .activations import compute_dtype, plan_sizes
from .head_activations import end_bytes
from .layer_activations import F32, SELECTIVE, Sizes, layer_bytes, selective_products
from .lora_costs import lora_flops
from .plan_parts import layer_kinds, loss_sharded, shard_styles
from ..plan.ranks import Shape, expert_groups
from .clock import Clock
from .hardware import Hardware

__all__ = ["StageTimes", "stage_times", "gathered_kv"]


@dataclass(frozen=True)
class StageTimes:
    """Seconds one microbatch spends on a stage, on each of its tp ranks (collectives included)."""

    forward: float
    input_backward: float  # with the recomputed forwards of checkpointed layers
    weight_backward: float
    tp_comm: float  # of the three above, the tensor-parallel collectives
    flops: float  # training FLOPs the stage runs per microbatch, without recompute (for MFU)
    cp_comm: float = 0.0  # of the three above, the context-parallel K/V gathers and their reduce-scatters
    ep_comm: float = 0.0  # of the three above, the expert-parallel exchanges of routed rows

    @property
    def backward(self) -> float:
        """A whole backward (B): the input and weight gradients together."""
        return self.input_backward + self.weight_backward


@functools.lru_cache(maxsize=1024)
def _crossing(shape: Shape, gpus_per_node: int) -> tuple[bool, bool, bool]:
    """Whether some tp, cp and ep group of `shape` spans nodes of `gpus_per_node` devices (global ranks fill
    nodes in order): its collectives then run at the network's speed, a step waiting for its slowest group."""
    spans = lambda groups: any(len({r // gpus_per_node for r in g}) > 1 for g in groups)  # noqa: E731
    return spans(shape.along("tp")), spans(shape.along("cp")), spans(expert_groups(shape)[0])


def gathered_kv(z: Sizes, ta: int = 1, kv_share: int = 1) -> float:
    """Bytes of the whole sequence's keys and values a cp rank gathers in a layer (its tp share of the heads)."""
    return 2 * z.batch_size * z.seq_len * z.kv_heads * kv_share * z.head_dim * z.dtype_bytes / ta


def _layer(z: Sizes, flop_parts: dict[str, int], clock: Clock, splits: dict, *, first: bool, recomputed: set[str],
           weights: int, experts_split: bool = False):
    """(F, I, W, tp collectives, training FLOPs, cp collectives, ep exchanges) of one decoder layer, whose
    forward FLOPs over one sequence are `flop_parts` (`layer_flop_parts`)."""
    c = z.cp
    parts = {k: v * z.batch_size / (1 if k == "scores" else c) for k, v in flop_parts.items()}
    if c > 1:  # (2c + 1) L^2 pairs computed, L = s / 2c, charged twice as the causal s^2 / 2 are
        parts["scores"] *= (2 * c + 1) / (2 * c * c)
    ta = z.tp if splits["attention_split"] else 1
    tm = z.tp if splits["mlp_split"] else 1
    ts = z.tp if splits.get("shared_split") and z.top_k and z.shared_width else 1  # shared experts over tp
    kv_share = z.kv_replicas if splits["attention_split"] else 1
    proj = (parts["q_o"] + parts["k_v"] * kv_share) / ta + parts.get("latent", 0)  # latent attention's, whole
    # ep borrowing tp ranks (u = t): each tp rank runs 1/u of the tokens through their k routed experts.
    u = z.routed_split if experts_split else 1
    routed = 6 * z.tokens * z.hidden * z.top_k * z.expert_width
    shared = 6 * z.tokens * z.hidden * z.shared_width if z.top_k else 0
    scores, mlp = parts["scores"] / ta, (parts["mlp"] - routed * (1 - 1 / u) - shared) / tm + shared / ts
    on_parts = z.split_sequence and z.top_k and tm == 1  # a MoE block on the rank's part: all of it per token
    if on_parts:
        mlp, u = parts["mlp"] / z.tp, (z.tp if experts_split else 1)
    norms = parts["norms"] / (z.tp if z.split_sequence else 1)
    # The whole sequence's keys and values, gathered in F and their gradients reduce-scattered in I.
    kv_bytes = gathered_kv(z, ta, kv_share)
    kv, own = clock.cp_gather(kv_bytes), clock.cp_work(kv_bytes) / 2  # cp's own work: half in F, half in I
    kept, _ = layer_bytes(z, **splits, first=first)
    block = z.tokens * z.dtype_bytes * z.hidden  # T h B: what a block's collective moves
    blocks = int(ta > 1) + int(tm > 1) + int(ts > 1)  # split shared experts: a collective of their own
    if z.split_sequence:
        fwd_comm = bwd_comm = blocks * 2 * clock.gather(block)
    else:
        fwd_comm = bwd_comm = blocks * clock.all_reduce(block)
    if u > 1 and not on_parts:  # the chunks' outputs all-gathered over tp in F, their tokens' and weights' gradients in I
        fwd_comm += clock.gather(block)
        bwd_comm += clock.gather(z.tokens * z.dtype_bytes * (z.hidden + z.top_k))
    # The routed rows to their experts' ranks and back (each way once in F, once more in I); F first exchanges
    # the rows' counts per expert (8 bytes each, a few per rank: latency).
    rows = z.tokens * z.top_k * z.dtype_bytes // u if experts_split else 0
    ep = clock.exchange(rows * (z.hidden + 1)) + clock.exchange(rows * z.hidden) if rows else 0.0
    ep_f = ep + clock.exchange(8 * clock.ep) if rows else 0.0
    # LoRA: each adapter's two products in F, again in I (through B, then A) and in W (their gradients); the
    # frozen weights get none, so W computes the adapters' alone.
    adapters = lora_flops(z, ta, tm, kv_share) if z.lora_rank else 0.0
    trained = adapters if z.lora_rank else proj + mlp
    forward = (clock.run(proj + scores + mlp + norms + adapters, 2 * kept, weights) + fwd_comm + kv + ep_f
               + clock.overhead + own)
    input_backward = (clock.run(proj + 2 * scores + mlp + 2 * norms + adapters, 3 * kept, weights) + bwd_comm + kv
                      + ep + clock.overhead + own)
    weight_backward = clock.run(trained, 0, 0 if z.lora_rank else 2 * weights) + clock.overhead
    # A checkpointed layer runs its forward again in the backward; a checkpointed block about half of it.
    share = 1.0 if "" in recomputed else len(recomputed & {ATTENTION.layer_part, MLP.layer_part}) / 2
    input_backward += share * forward
    # Checkpointed 'selective': its elementwise work, collectives and the products it did not keep again, and
    # the policy's own cost (the measured `selective_overhead_s`; a block, half).
    for unit, weight, again in _selective_units(z, recomputed, splits, proj, mlp):
        input_backward += (clock.run(again + weight * norms, weight * 2 * kept, 0)
                           + weight * (fwd_comm + clock.overhead + clock.selective))
        share += weight
    tp_comm = fwd_comm + bwd_comm + share * fwd_comm
    flops = (proj + scores + mlp + norms + adapters) + (proj + 2 * scores + mlp + 2 * norms + adapters) + trained
    return forward, input_backward, weight_backward, tp_comm, flops, (2 + share) * kv, (1 + share) * ep_f + ep


def _selective_units(z: Sizes, recomputed: set[str], splits: dict, proj: float, mlp: float):
    """(unit, its share of the layer, the projection FLOPs it runs again) for each part of a layer checkpointed
    'selective' (`layer_activations.selective_products`): the whole layer, or self_attn and mlp alone."""
    units = {"": (LAYER_PARTS, 1.0, proj + mlp), ATTENTION.layer_part: ([ATTENTION.layer_part], 0.5, proj),
             MLP.layer_part: ([MLP.layer_part], 0.5, mlp)}
    wanted = {"": True} if SELECTIVE in recomputed else {p: True for p in units if p and SELECTIVE + p in recomputed}
    for unit in wanted:
        parts, weight, flops = units[unit]
        _, again = selective_products(z, parts, attention_split=splits["attention_split"], mlp_split=splits["mlp_split"])
        yield unit, weight, again * flops


def unsplit_stages(resolved: ResolvedPlan) -> frozenset[int]:
    """The stages whose backward the runner does not split into I and W: those of a pp rank that recomputes a
    module (`activation_checkpointing`; a split backward would recompute once per weight group), whose I then
    runs the whole backward and whose W is empty (`pipeline.step_state`), as a compiled block's."""
    if not resolved.recomputed:
        return frozenset()
    return _unsplit(resolved.recomputed, resolved.stage_rank, tuple(stage.modules for stage in resolved.stages))


@functools.lru_cache(maxsize=256)  # a search asks it of every candidate of a binding
def _unsplit(recomputed: tuple[str, ...], stage_rank: tuple[int, ...], modules: tuple[tuple[str, ...], ...]):
    owner = {m: s for s, held in enumerate(modules) for m in held}
    ranks = set()
    for path in recomputed:  # the stage holding it: its own path, or the nearest enclosing one a stage lists
        parts = path.split(".")
        stage = next((owner[p] for p in (".".join(parts[:k]) for k in range(len(parts), 0, -1)) if p in owner), None)
        if stage is not None:
            ranks.add(stage_rank[stage])
    return frozenset(s for s, r in enumerate(stage_rank) if r in ranks)


def _routed_layers(resolved: ResolvedPlan) -> set[int]:
    """Indices of the decoder layers whose experts are split over ep."""
    prefix = resolved.backbone.layers + "."
    return {int(fqn[len(prefix):].partition(".")[0]) for fqn in (spec.fqn for spec in resolved.experts)
            if fqn.startswith(prefix) and fqn[len(prefix):].partition(".")[0].isdigit()}


def _head(z: Sizes, clock: Clock, *, head_style: str | None, sharded_loss: bool, weights: int, has_head: bool):
    """(F, I, W, tp collectives, FLOPs) of the final norm, LM head and loss on the last stage."""
    T, h, V, B = z.tokens, z.hidden, z.vocab, z.dtype_bytes
    norm = NORM_FLOPS * T * h / (z.tp if z.split_sequence else 1)
    kept = end_bytes(z, has_head=has_head, loss_parallel=sharded_loss)
    if not has_head:
        return clock.run(norm, 2 * kept), clock.run(2 * norm, 2 * kept), 0.0, 0.0, 3 * norm
    t = z.tp if head_style in ("column", "column_gather") else 1
    product = 2 * T * h * V / t
    loss = LOSS_FLOPS * T * V / (t if sharded_loss else 1)
    fwd_comm = bwd_comm = 0.0
    if t > 1:
        split_input = T * h * B
        fwd_comm = clock.gather(split_input) if z.split_sequence else 0.0
        bwd_comm = clock.gather(split_input) if z.split_sequence else clock.all_reduce(split_input)
        fwd_comm += clock.gather(T * 2 * F32 * t) if sharded_loss else clock.gather(T * V * B)
    forward = clock.run(product + loss + norm, 2 * kept, weights) + fwd_comm
    input_backward = clock.run(product + loss + 2 * norm, 2 * kept, weights) + bwd_comm
    trained = 0 if z.lora_rank else product  # a frozen head (LoRA) computes no weight gradient
    weight_backward = clock.run(trained, 0, 2 * weights if trained else 0)
    return forward, input_backward, weight_backward, fwd_comm + bwd_comm, 2 * product + trained + 2 * loss + 3 * norm


def stage_times(
    resolved: ResolvedPlan, model: nn.Module, hardware: Hardware, *, batch_size: int = 1, gpus_per_node: int | None = None,
    layer_weights: dict[int, int] | None = None, root_weights: tuple[int, int] = (0, 0),
    dtype: str | torch.dtype | None = None, sizes: Sizes | None = None,
) -> list[StageTimes]:
    """Each stage's times for one microbatch of `batch_size` sequences of pipeline.seq_len tokens.

    Args:
        resolved: a LLaMA-family plan (`activations.activation_problem` is None), its run
            settings applied (`memory.with_run`).
        model: the model it was resolved against (meta will do).
        hardware: the profile.
        gpus_per_node: devices per node (default the profile's), for the tp group's link.
        layer_weights: per decoder layer, the bytes of its weights on a rank (default 0: no weight traffic).
        root_weights: bytes of (the embedding, the final norm and head) on a rank.
        dtype: the compute dtype (default the parameters'): its peak FLOP/s, its activation bytes.
        sizes: `activations.plan_sizes` of this plan, batch size and dtype, when the caller has them.

    Example:
        >>> [round(t.forward, 4) for t in stage_times(resolved, model, load_hardware("h100-sxm"))]
    """
    bb, config = resolved.backbone, model.config
    z = sizes or plan_sizes(resolved, model, batch_size=batch_size, dtype=dtype)
    styles = shard_styles(resolved)
    G = gpus_per_node or hardware.devices_per_node
    cp, ep = resolved.plan.mesh.cp, resolved.plan.mesh.ep
    tp_link, cp_link, ep_link = (hardware.inter_node if crossing else hardware.intra_node
                                 for crossing in _crossing(resolved.plan.mesh.shape, G))
    compiled = resolved.plan.compile
    hardware = hardware.stepping(compiled is not None and compiled.backend == "inductor")
    clock = Clock(hardware, str(compute_dtype(model, dtype)).removeprefix("torch."), resolved.tp, tp_link,
                   cp, cp_link, ep, ep_link, traced=compiled is not None, tokens=z.tokens)
    flop_parts = layer_flop_parts(config, seq_len=z.seq_len)
    routed_layers = _routed_layers(resolved) if ep > 1 else set()
    layer_weights = layer_weights or {}
    last, out, memo, whole = resolved.num_stages - 1, [], {}, unsplit_stages(resolved)
    for stage, kinds in enumerate(layer_kinds(resolved, styles)):
        f = i = w = comm = flops = kv = ep_comm = 0.0
        for index, splits, parts in kinds:
            routed = index in routed_layers
            key = (tuple(splits.values()), index == 0, parts, layer_weights.get(index, 0), routed)
            if key not in memo:  # decoder layers alike in shape: one computation each
                memo[key] = _layer(z, flop_parts, clock, splits, first=index == 0, recomputed=parts, weights=key[3],
                                   experts_split=routed)
            lf, li, lw, lc, lflops, lkv, lep = memo[key]
            f, i, w, comm, flops, kv, ep_comm = f + lf, i + li, w + lw, comm + lc, flops + lflops, kv + lkv, ep_comm + lep
        if stage == 0:
            embed = z.tokens * z.dtype_bytes * z.hidden
            vocab_comm = clock.all_reduce(embed) if styles.get(bb.embed) == "vocab" else 0.0
            f += clock.run(0, 2 * embed) + vocab_comm
            w += clock.run(0, 2 * embed)  # the backward scatter-adds the output gradient into the table
            comm += vocab_comm
        if stage == last:
            hf, hi, hw, hc, hflops = _head(z, clock, head_style=styles.get(bb.head) if bb.head else None,
                                           sharded_loss=loss_sharded(resolved, styles), weights=root_weights[1],
                                           has_head=bb.has_head)
            f, i, w, comm, flops = f + hf, i + hi, w + hw, comm + hc, flops + hflops
        # What a stage's forward and backward calls cost a microbatch outside its layers, half in each.
        f, i = f + hardware.microbatch_overhead_s / 2, i + hardware.microbatch_overhead_s / 2
        if compiled is not None or stage in whole:  # I runs the backward whole, W has nothing left
            i, w = i + w, 0.0
        out.append(StageTimes(f, i, w, comm, flops, kv, ep_comm))
    return out
