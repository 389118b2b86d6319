"""The candidates of each mesh a plan search tries: every binding of the mesh (switches, virtual stages,
expert parallelism) with its schedules, microbatch counts, shardings and checkpointing, the best that fits.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass

from ..plan.schema import Compile
from ..plan.schema import ParallelPlan
from ..schedules import splits_backward
from .activations import activation_problem
from .bind_memo import MemoSteps
from .search_space import (
    CHECKPOINTING, SCHEDULES_BY_STAGES, Bound, bind, binds_sp, divisors, expert_count, meshes, microbatch_counts,
    variant,
)
from .step_time import predict_step

__all__ = ["Candidate", "best_per_mesh"]


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
        """`dp=2 x pp=2 x tp=2, 1f1b, 8 x 2 seqs, full, sp + vocab/loss, checkpointing off` (`, compiled` under
        `compile`)."""
        plan, pipe = self.plan, self.plan.pipeline
        switches = [name for on, name in ((plan.sequence_parallel, "sp"), (plan.loss_parallel, "vocab/loss")) if on]
        k = f" x{pipe.virtual_stages} stages" if pipe.virtual_stages > 1 else ""
        shared = plan.mesh.dp * plan.mesh.cp > 1  # ranks holding the same parameters: dp replicas x cp ranks
        return (f"{plan.mesh.shape_text()}, {pipe.schedule}{k}, {pipe.microbatches} x {self.batch_size} seq, "
                f"{plan.data_parallel.sharding if shared else 'no dp'}"
                f"{' reduced per microbatch' if shared and plan.data_parallel.reduce == 'microbatch' else ''}, "
                f"{' + '.join(switches) or 'no switches'}, checkpointing {self.checkpointing}"
                f"{', compiled' if plan.compile is not None else ''}")


def best_per_mesh(model, hw, *, world, G, limit, seq_len, batch, timed: bool, frugal: bool = False,
            dtype: str | None = None, max_cp: int | None = 1, lora: dict | None = None,
            compiled: bool | None = False) -> dict:
    """The best fitting candidate per (dp, pp, cp, tp); `timed` False: fit only (unit
    times), `frugal`: the least memory per mesh only (full sharding, every layer checkpointed); `lora`: every
    plan's `lora` section (the adapters trained, every other weight frozen); `compiled`: every plan compiled
    (`compile: true`), none (False), or each binding both ways, the faster kept (None)."""
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
                        steps=binds, cp=cp, ep=ep, lora=lora)
            if isinstance(base, str):
                continue
            problem = activation_problem(base, model)
            if problem:
                raise ValueError(f"the planner estimates LLaMA-shaped layers only: {problem}")
            plain = None if frugal and tp > 1 else Bound(base, model, dtype)
            bounds += [plain] if plain else []
            if tp > 1 and (tp, vocab_loss) not in sp_binds:
                sp_binds[tp, vocab_loss] = binds_sp(model, base, binds)
            if tp > 1 and sp_binds[tp, vocab_loss]:
                # Sequence parallelism changes no shard or stage: the same binding with the switch on.
                plan = base.plan.model_copy(update={"sequence_parallel": True})
                bounds.append(Bound(dataclasses.replace(base, plan=plan), model, dtype, twin=plain))
        if timed and compiled is not False:  # compiling moves no parameter: the same binding, timed apart
            twins = [Bound(dataclasses.replace(b.base, plan=b.base.plan.model_copy(update={"compile": Compile()})),
                           model, dtype, twin=b) for b in bounds]
            bounds = twins if compiled else bounds + twins  # on a tie the eager plan, named first, stays
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


def _fits(bound: Bound, group: tuple, mode: str, batch_size: int, limit: float) -> tuple[bool, int | None]:
    """(the parameters fit, the busiest rank's peak when the activations fit too, else None) of the binding's
    candidate `group` (schedule, microbatches, sharding, reduce) under checkpointing `mode`."""
    schedule, m, sharding, reduce = group
    feet = bound.footprint_peaks(schedule, m, sharding, reduce)
    if min(feet) > limit:
        return False, None
    acts = bound.activation_peaks(schedule, m, mode, batch_size)  # builds the table
    peak = max(f + a for f, a in zip(feet, acts))
    return True, (peak if peak <= limit else None)


def _first_fit(bound: Bound, *, G, limit, n, frugal) -> Candidate | None:
    """Fit only: the first candidate of this binding that fits (no times)."""
    for group in _groups(bound, n, frugal):
        for mode in CHECKPOINTING[-1:] if frugal else CHECKPOINTING:
            if not bound.allows(mode):
                continue
            params_fit, peak = _fits(bound, group, mode, n // group[1], limit)
            if not params_fit:
                break  # the parameters alone do not fit: checkpointing cannot help
            if peak is not None:
                schedule, m, sharding, reduce = group
                v = variant(bound.base, schedule=schedule, microbatches=m, sharding=sharding, checkpointing=mode,
                            reduce=reduce)
                return Candidate(v.plan, n // m, 0.0, 0.0, 0.0, 0.0, peak, True, mode)
    return None


def _fastest(bounds: list[Bound], hw, *, G, limit, n) -> Candidate | None:
    """The fastest fitting candidate over a mesh's bindings, each (schedule, microbatches, sharding)
    with the least checkpointing that fits. What fits is settled first (it needs no hardware, and its
    pieces are shared between candidates); the fitting candidates are then tried by their lower bound,
    least first, and the search stops once no bound can beat the best found; equal steps go to the one
    named first (the order of `_groups`), as an exhaustive pass in that order would choose."""
    heap, best, best_key = [], None, None
    for order, (bound, group) in enumerate((b, g) for b in bounds for g in _groups(b, n)):
        fitting = _least_checkpointing(bound, group, n // group[1], limit)
        if fitting is not None:
            mode, peak = fitting
            low = bound.lower_bound(*group, mode, n // group[1], hw, G)
            heap.append((low, order, mode, peak, group, bound))
    heapq.heapify(heap)
    while heap:
        low, order, mode, peak, group, bound = heapq.heappop(heap)
        if best_key is not None and (low, order) >= best_key:
            break  # neither this nor any candidate left (their bounds are at least this one) beats the best
        schedule, m, sharding, reduce = group
        v = variant(bound.base, schedule=schedule, microbatches=m, sharding=sharding, checkpointing=mode,
                    reduce=reduce)
        got = predict_step(v, bound.model, hw, batch_size=n // m, gpus_per_node=G,
                           parameters=bound.parameters, sim_cache=bound.sims, dp_time=bound.dp_time(hw, G),
                           dtype=bound.compute, times=bound.stage_times(mode, n // m, hw, G),
                           sizes=bound.sizes(n // m))
        if got.step_s < low:
            raise RuntimeError(f"the plan search bounded {got.step_s} s from below by {low} s for {v.plan.mesh.shape_text()}, "
                               f"{schedule}, {m} microbatches: a bug in rewrite.estimate.step_bound")
        if best_key is None or (got.step_s, order) < best_key:
            best_key = (got.step_s, order)
            best = Candidate(v.plan, n // m, got.step_s, got.tokens_per_s, got.mfu, got.bubble, peak, True, mode)
    return best


def _least_checkpointing(bound: Bound, group: tuple, batch_size: int, limit: float) -> tuple[str, int] | None:
    """(the least checkpointing mode under which the candidate fits, its busiest rank's peak), or None."""
    if min(bound.footprint_peaks(*group)) > limit:
        return None  # the parameters alone do not fit: checkpointing cannot help
    for mode in CHECKPOINTING:
        if bound.allows(mode):  # the last mode always is
            _, peak = _fits(bound, group, mode, batch_size, limit)
            if peak is not None:
                return mode, peak
    return None
