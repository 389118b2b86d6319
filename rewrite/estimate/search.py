"""The plan search: every valid (dp, pp, cp, tp), schedule, microbatch count, sharding and switch,
the ones whose busiest rank fits the device memory, ranked by predicted step time.

For each mesh (tp within a node, cp where 2 cp chunks split the sequence, each layout `resolve`
accepts) and each choice of
vocab + loss parallelism and sequence parallelism the plan is bound once (`auto` cuts, per
virtual-stage count; for a mixture of experts computed in its parameters' dtype, per ep dividing
dp x tp and the experts: the best of each mesh may split its experts); schedules, microbatch counts, data-parallel sharding and activation
checkpointing (off, every other layer, every layer) vary on that binding. Each candidate's
memory is `estimate.memory.rank_memory`'s, its time `estimate.step_time.predict_step`'s.
Checkpointing only adds time, so a candidate takes the least of it that fits.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass

from torch import nn

from ..errors import RewriteError
from ..binding.resolve import ResolvedPlan, resolve
from ..plan.loading import load_plan
from ..plan.schema import ParallelPlan
from ..schedules import splits_backward
from ..values import is_count
from .activations import activation_problem, compute_dtype
from .bind_memo import MemoSteps
from .hardware import Hardware, default_dtype, load_hardware
from .memory import GIB, rank_memory
from .search_space import (
    CHECKPOINTING, SCHEDULES_BY_STAGES, Bound, bind, binds_sp, collector_paused, divisors, expert_count, meshes,
    microbatch_counts, variant,
)
from .step_time import predict_step

__all__ = ["Candidate", "NoPlanFits", "suggest_plans", "check_arguments"]



@dataclass(frozen=True)
class Candidate:
    """A plan with its predicted step and its busiest rank's memory."""

    plan: ParallelPlan
    batch_size: int  # sequences per microbatch: the global batch / (dp x microbatches)
    step_s: float
    tokens_per_s: float  # per device
    mfu: float
    bubble: float
    peak_bytes: int  # the busiest rank's estimated peak
    fits: bool
    checkpointing: str  # one of CHECKPOINTING
    dtype: str = "float32"  # the compute dtype counted, over the model's parameters (float32 master weights)

    def as_dict(self) -> dict:
        """`{"plan": {...}, "batch_size", "step_s", "tokens_per_s", "mfu", "bubble", "peak_bytes", "fits", ...}`."""
        return {"plan": self.plan.model_dump(mode="json", exclude_none=True), "batch_size": self.batch_size,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bubble": self.bubble,
                "peak_bytes": self.peak_bytes, "fits": self.fits, "checkpointing": self.checkpointing,
                "dtype": self.dtype, "summary": self.summary()}

    def summary(self) -> str:
        """`dp=2 x pp=2 x tp=2, 1f1b, 8 x 2 seqs, full, sp + vocab/loss, checkpointing off`."""
        plan, pipe = self.plan, self.plan.pipeline
        switches = [name for on, name in ((plan.sequence_parallel, "sp"), (plan.loss_parallel, "vocab/loss")) if on]
        k = f" x{pipe.virtual_stages} stages" if pipe.virtual_stages > 1 else ""
        shared = plan.mesh.dp * plan.mesh.cp > 1  # ranks holding the same parameters: dp replicas x cp ranks
        return (f"{plan.mesh.shape_text()}, {pipe.schedule}{k}, {pipe.microbatches} x {self.batch_size} seq, "
                f"{plan.data_parallel.sharding if shared else 'no dp'}"
                f"{' reduced per microbatch' if shared and plan.data_parallel.reduce == 'microbatch' else ''}, "
                f"{' + '.join(switches) or 'no switches'}, checkpointing {self.checkpointing}")


class NoPlanFits(RewriteError, ValueError):
    """No candidate's busiest rank fits the device memory; `advice` says what would fit."""

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(f"{message}; {advice}" if advice else message)
        self.advice = advice


def _model(model_or_config) -> nn.Module:
    """The model to plan: a config's built on the meta device in float32, as `rewrite train` holds its weights."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_or_config, dtype=torch.float32)


def planned_dtype(model: nn.Module, hw: Hardware, given: str | None) -> str:
    """The compute dtype a search counts: `given`, else the profile's default (`default_dtype`), never
    wider than the model's parameters (the master weights)."""
    import torch

    if given is not None:
        compute_dtype(model, given)  # a floating dtype's name, or ValueError
        return given
    master = compute_dtype(model)
    chosen = default_dtype(hw)
    return chosen if getattr(torch, chosen).itemsize <= master.itemsize else str(master).removeprefix("torch.")


def check_arguments(world, device_memory, seq_len, global_batch, gpus_per_node) -> None:
    """ValueError naming the first of `suggest_plans`' sizes that is not a whole number >= 1 (memory: > 0)."""
    for name, value in (("world", world), ("seq_len", seq_len), ("global_batch", global_batch),
                        ("gpus_per_node", gpus_per_node)):
        if value is not None and not is_count(value):
            raise ValueError(f"`{name}` is {value!r}; use a whole number >= 1")
    if device_memory is not None and not (isinstance(device_memory, (int, float)) and device_memory > 0):
        raise ValueError(f"`device_memory` is {device_memory!r} GiB; use a number above 0")


def suggest_plans(
    model_or_config,
    *,
    world: int,
    device_memory: float | None = None,
    gpus_per_node: int | None = None,
    seq_len: int = 2048,
    global_batch: int | None = None,
    hardware: Hardware | str = "h100-sxm",
    dtype: str | None = None,
    max_cp: int | None = None,
) -> list[Candidate]:
    """The plans that fit, fastest first by predicted step time: the best of each (dp, pp, cp, tp).

    Args:
        model_or_config: a transformers causal LM (meta will do) or its config.
        world: devices.
        device_memory: GiB per device (default: the profile's memory_gib).
        gpus_per_node: devices per node (default: the profile's); tp stays within a node.
        seq_len: tokens per sequence.
        global_batch: sequences per step over all replicas (default 4 x world); each replica's
            share is split into microbatches of equal size.
        hardware: a profile, its name or file (`estimate.hardware.load_hardware`).
        dtype: the compute dtype (`apply_plan`'s compute_dtype, `rewrite train --dtype`) over the
            parameters' dtype, which a config's model takes as float32 (the master weights
            `rewrite train` keeps); default: bfloat16 on a profile whose bfloat16 peak passes its
            float32 one (a GPU), else float32 (`hardware.default_dtype`).
        max_cp: the most context-parallel ranks a plan may split a sequence over (default: any the
            world and seq_len allow); 1 leaves context parallelism out, as for a family whose attention
            it cannot run (`rewrite.context_parallel.family.context_parallel_problem`; `rewrite plan`
            checks it).

    Returns:
        One `Candidate` per (dp, pp, cp, tp) that fits, ranked by `step_s`: for each, the schedule,
        microbatch count, sharding, switches and least checkpointing that predict the fastest step.

    Raises:
        ValueError: a bad argument (world, memory, ...), an unknown hardware, or a model whose
            layers the estimates do not cover.
        NoPlanFits: nothing fits; its `advice` names the smallest world that would, or the
            sequence length that fits on this one.

    Example:
        >>> best = rewrite.suggest_plans(LlamaConfig(...), world=8, device_memory=80)[0]
        >>> best.plan.mesh.shape_text(), round(best.step_s, 3)
    """
    check_arguments(world, device_memory, seq_len, global_batch, gpus_per_node)
    if max_cp is not None and not is_count(max_cp):
        raise ValueError(f"`max_cp` is {max_cp!r}; use a whole number >= 1")
    hw = load_hardware(hardware)
    model = _model(model_or_config)
    dtype = planned_dtype(model, hw, dtype)
    G = gpus_per_node or hw.devices_per_node
    limit = (device_memory or hw.memory_gib) * GIB
    batch = global_batch or 4 * world
    with collector_paused():
        best = _search(model, hw, world=world, G=G, limit=limit, seq_len=seq_len, batch=batch, timed=True, dtype=dtype,
                       max_cp=max_cp)
        if not best:
            raise NoPlanFits(
                f"no plan fits: no layout of {world} device(s) at {limit / GIB:g} GiB each holds "
                f"{type(model).__name__} at {seq_len} tokens x {batch} sequences",
                _advice(model, hw, world=world, G=G, limit=limit, seq_len=seq_len, batch=batch, dtype=dtype,
                        max_cp=max_cp),
            )
    ranked = sorted((dataclasses.replace(c, dtype=dtype) for c in best.values()), key=lambda c: c.step_s)
    _verify(ranked[0], model, dtype)
    return ranked


def _verify(best: Candidate, model: nn.Module, dtype: str) -> None:
    """The best plan bound afresh, from its own data, must hold what the search estimated for it."""
    resolved = resolve(load_plan(best.plan.model_dump(mode="json", exclude_none=True)), model)
    peak = max(m.total for m in rank_memory(resolved, model, batch_size=best.batch_size, dtype=dtype))
    if peak != best.peak_bytes:
        raise RuntimeError(f"the plan search estimated {best.peak_bytes} bytes for {best.summary()}, its plan binds to "
                           f"{peak}: a bug in rewrite.estimate.search")


def _search(model, hw, *, world, G, limit, seq_len, batch, timed: bool, frugal: bool = False,
            dtype: str | None = None, max_cp: int | None = 1) -> dict:
    """The best fitting candidate per (dp, pp, cp, tp); `timed` False: fit only (unit
    times), `frugal`: the least memory per mesh only (full sharding, every layer checkpointed)."""
    from ..models.hf_decoder import find_backbone

    num_layers = find_backbone(model).num_layers
    # A mixture of experts whose family's ep plan splits them: ep joins the search.
    experts = expert_count(model)
    best: dict = {}
    sp_binds: dict = {}  # (tp, vocab_loss) -> whether sequence parallelism binds
    binds = MemoSteps(model)  # the binding steps kept: the shards per (tp, switches), the parameters per stage set
    for dp, pp, cp, tp in meshes(world, G, num_layers, seq_len=seq_len, max_cp=max_cp):
        if batch % dp:
            continue
        n = batch // dp
        bounds = []  # every binding of this mesh: switches, virtual stages and expert parallelism
        eps = [e for e in divisors(dp * tp) if experts % e == 0] if experts else [1]
        switches = ((True,) if frugal else (False, True)) if tp > 1 else (False,)
        stages = (2, 1) if pp > 1 and 2 * pp <= num_layers and not frugal else (1,)
        for vocab_loss, k, ep in itertools.product(switches, stages, eps):
            base = bind(model, dp=dp, pp=pp, tp=tp, k=k, vocab_loss=vocab_loss, sp=False, seq_len=seq_len,
                        steps=binds, cp=cp, ep=ep)
            if isinstance(base, str):
                continue
            problem = activation_problem(base, model)
            if problem:
                raise ValueError(f"the planner estimates LLaMA-shaped layers only: {problem}")
            bases = [] if frugal and tp > 1 else [base]
            if tp > 1 and (tp, vocab_loss) not in sp_binds:
                sp_binds[tp, vocab_loss] = binds_sp(model, base, binds)
            if tp > 1 and sp_binds[tp, vocab_loss]:
                # Sequence parallelism changes no shard or stage: the same binding with the switch on.
                plan = base.plan.model_copy(update={"sequence_parallel": True})
                bases.append(dataclasses.replace(base, plan=plan))
            bounds += [Bound(b, model, dtype) for b in bases]
        if not timed:
            found = next(filter(None, (_first_fit(b, G=G, limit=limit, n=n, frugal=frugal) for b in bounds)), None)
        else:
            found = _fastest(bounds, hw, G=G, limit=limit, n=n)
        if found is not None:
            best[dp, pp, cp, tp] = found
    return best


def _groups(bound: Bound, n: int, frugal: bool = False):
    """(schedule, microbatches, sharding, reduce) of one binding, in the order the search names them."""
    mesh, pp, k = bound.base.plan.mesh, bound.base.pp, bound.base.plan.pipeline.virtual_stages
    dp = mesh.dp * mesh.cp  # the ranks a sharding spreads the parameters over
    schedules = ("1f1b",) if frugal else SCHEDULES_BY_STAGES[k] if pp > 1 else ("1f1b", "afab")
    shardings = ("full",) if dp == 1 or frugal else ("replicate", "grad_op", "full")  # the fastest first
    for schedule in schedules:
        # Reduced once a step (least traffic) first; per microbatch where it holds less: sharded, whole backwards.
        reduces = ("step", "microbatch") if dp > 1 and not splits_backward(schedule) else ("step",)
        reduces = reduces[::-1] if frugal else reduces  # the least memory: whole gradients one layer at a time
        for m in (n,) if frugal else sorted(microbatch_counts(n, pp * k), reverse=True):
            alone = m == 1 and k == 1  # one whole backward a rank: `step` reduces as it goes (`reduce_as_run`)
            for sharding in shardings:
                for reduce in reduces if sharding != "replicate" and not alone else ("step",):
                    yield schedule, m, sharding, reduce


def _fits(bound: Bound, v: ResolvedPlan, mode: str, batch_size: int, limit: float) -> tuple[bool, int | None]:
    """(the parameters fit, the busiest rank's peak when the activations fit too, else None)."""
    pipe, dpp = v.plan.pipeline, v.plan.data_parallel
    feet = bound.footprint_peaks(v, dpp.sharding, splits_backward(pipe.schedule), dpp.reduce)
    if min(feet) > limit:
        return False, None
    acts = bound.activation_peaks(v, pipe.schedule, pipe.microbatches, mode, batch_size)  # builds the table
    peak = max(f + a for f, a in zip(feet, acts))
    return True, (peak if peak <= limit else None)


def _first_fit(bound: Bound, *, G, limit, n, frugal) -> Candidate | None:
    """Fit only: the first candidate of this binding that fits (no times)."""
    for schedule, m, sharding, reduce in _groups(bound, n, frugal):
        for mode in CHECKPOINTING[-1:] if frugal else CHECKPOINTING:
            v = variant(bound.base, schedule=schedule, microbatches=m, sharding=sharding, checkpointing=mode,
                        reduce=reduce)
            params_fit, peak = _fits(bound, v, mode, n // m, limit)
            if not params_fit:
                break  # the parameters alone do not fit: checkpointing cannot help
            if peak is not None:
                return Candidate(v.plan, n // m, 0.0, 0.0, 0.0, 0.0, peak, True, mode)
    return None


def _fastest(bounds: list[Bound], hw, *, G, limit, n) -> Candidate | None:
    """The fastest fitting candidate over a mesh's bindings, each (schedule, microbatches, sharding)
    with the least checkpointing that fits. Candidates are tried by their lower bound, least first,
    and the search stops once no bound can beat the best found; equal steps go to the one named first
    (the order of `_groups`), as an exhaustive pass in that order would choose."""
    heap, best, best_key = [], None, None

    def push(order, bound, group, mode_index):
        low = bound.lower_bound(*group, CHECKPOINTING[mode_index], n // group[1], hw, G)
        heapq.heappush(heap, (low, order, mode_index, group, bound))

    order = 0
    for bound in bounds:
        for group in _groups(bound, n):
            push(order, bound, group, 0)
            order += 1
    while heap:
        low, order, mode_index, group, bound = heapq.heappop(heap)
        if best_key is not None and (low, order) >= best_key:
            break  # neither this nor any candidate left (their bounds are at least this one) beats the best
        schedule, m, sharding, reduce = group
        v = variant(bound.base, schedule=schedule, microbatches=m, sharding=sharding,
                    checkpointing=CHECKPOINTING[mode_index], reduce=reduce)
        params_fit, peak = _fits(bound, v, CHECKPOINTING[mode_index], n // m, limit)
        if not params_fit:
            continue  # the parameters alone do not fit: checkpointing cannot help
        if peak is None:  # the activations do not fit: the next checkpointing mode, if any
            if mode_index + 1 < len(CHECKPOINTING):
                push(order, bound, group, mode_index + 1)
            continue
        got = predict_step(v, bound.model, hw, batch_size=n // m, gpus_per_node=G,
                           parameters=bound.parameters, sim_cache=bound.sims, dp_time=bound.dp_time(hw, G),
                           dtype=bound.compute)
        if got.step_s < low:
            raise RuntimeError(f"the plan search bounded {got.step_s} s from below by {low} s for {v.plan.mesh.shape_text()}, "
                               f"{schedule}, {m} microbatches: a bug in rewrite.estimate.step_bound")
        if best_key is None or (got.step_s, order) < best_key:
            best_key = (got.step_s, order)
            best = Candidate(v.plan, n // m, got.step_s, got.tokens_per_s, got.mfu, got.bubble, peak, True,
                             CHECKPOINTING[mode_index])
    return best


def _advice(model, hw, *, world, G, limit, seq_len, batch, dtype, max_cp) -> str:
    """What would fit: the sequence length on this world, else the smallest world (doubling, up to 64x)."""
    fits = lambda **kw: bool(_search(model, hw, G=G, limit=limit, timed=False, frugal=True, dtype=dtype,  # noqa: E731
                                     max_cp=max_cp, **kw))
    if fits(world=world, seq_len=1, batch=batch):  # the parameters fit: some sequence length does
        s = seq_len // 2
        while s > 1 and not fits(world=world, seq_len=s, batch=batch):
            s //= 2
        return f"at `seq_len={max(s, 1)}` a plan fits on these {world} device(s)"
    for times in (2, 4, 8, 16, 32, 64):
        bigger = world * times
        if fits(world=bigger, seq_len=seq_len, batch=max(batch, bigger)):
            return (f"the smallest world that fits at this memory is {bigger} devices (`world={bigger}`, "
                    f"`global_batch` a multiple of the data-parallel size)")
    return f"not even {world * 64} devices fit at this memory; use devices with more memory"
