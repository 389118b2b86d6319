"""Parameter memory per rank under a plan: tensor-parallel shards, then data-parallel sharding.

Pure arithmetic on the parameters' shapes (a meta-device model will do); `memory.rank_memory` adds
the activations to what these count.

With data parallelism each rank's parameters become torch FSDP2 units
(`rewrite.data_parallel`) over the ranks holding the same parameters: the dp replicas times the
cp ranks (context parallelism splits the sequence, not the parameters), n = dp x cp of them below
("dp" in `footprint`). FSDP2 splits every parameter along dim 0, padded up to a
multiple of n, so a rank holds `ceil(d0 / n) * d1 * ...` elements of a `[d0, d1, ...]`
parameter. Gradients are synchronised once per step, so during a step each unit
accumulates whole gradients and stays gathered from its first backward to the step's
one reduce. `replicate` holds a second, gradient-sized buffer beside the parameters:
DDP's gradient buckets (one stage per rank, whole backwards), or FSDP2's gathered copy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..binding.params import held_parameters
from ..binding.resolve import ResolvedPlan
from ..schedules import splits_backward
from .activations import compute_dtype

__all__ = [
    "Footprint", "ParamSums", "REDUCES", "SHARDINGS", "footprint", "param_sums", "rank_footprints", "rank_parameters",
    "rank_held", "param_unit", "reduce_as_run",
]

SHARDINGS = ("full", "grad_op", "replicate")
REDUCES = ("step", "microbatch")
ADAMW_BYTES = 8  # AdamW's two moments (exp_avg, exp_avg_sq) per element, kept in float32


@dataclass(frozen=True)
class Footprint:
    """What one rank holds for its parameters: a count, then bytes."""

    params: int  # elements held between steps (FSDP2's padded shard, or whole)
    weights: int  # bytes, the parameters' dtype
    grads: int  # bytes after the step's reduce, the parameters' dtype
    adamw: int  # bytes, float32
    peak: int  # bytes at the step's worst moment: see `footprint`

    @property
    def at_rest(self) -> int:
        """Weights + gradients + AdamW state, between steps."""
        return self.weights + self.grads + self.adamw

    def __add__(self, other: Footprint) -> Footprint:
        """Two sets of parameters one rank holds (the dense ones and its experts), each counted as it is held."""
        return Footprint(*(a + b for a, b in zip(self._fields(), other._fields())))

    def _fields(self) -> tuple[int, ...]:
        return self.params, self.weights, self.grads, self.adamw, self.peak


def _dp_shard(shape: tuple[int, ...], dp: int) -> int:
    # FSDP2's shard of a parameter: dim 0 padded to a multiple of dp, then split (a scalar as [1]).
    shape = shape or (1,)
    return math.ceil(shape[0] / dp) * math.prod(shape[1:])


@dataclass(frozen=True)
class ParamSums:
    """One rank's parameters summed for `footprint`: whole, and as FSDP2 shards over dp (per unit); of those,
    the trained ones (with gradients and AdamW state: all of them, or a LoRA plan's adapters)."""

    dp: int
    whole: int  # elements
    whole_bytes: int
    held: int  # elements of the dp shards
    held_bytes: int
    unit_bytes: tuple[tuple[str | None, int], ...]  # per FSDP2 unit, of the dp shards
    trained: tuple[int, int, int, int] | None = None  # (whole, whole_bytes, held, held_bytes) trained; None: all

    @property
    def taught(self) -> tuple[int, int, int, int]:
        """(whole, whole_bytes, held, held_bytes) of the trained parameters."""
        return self.trained or (self.whole, self.whole_bytes, self.held, self.held_bytes)


def param_sums(params: list[tuple], dp: int) -> ParamSums:
    """`footprint`'s sums of (shape, bytes per element[, unit[, trained]]) parameters: one pass over them."""
    whole = whole_bytes = held = held_bytes = 0
    taught = [0, 0, 0, 0]
    units: dict = {}
    for p in params:
        count, shard = math.prod(p[0]), _dp_shard(p[0], dp)
        unit = p[2] if len(p) > 2 else None
        whole, whole_bytes = whole + count, whole_bytes + count * p[1]
        held, held_bytes, units[unit] = held + shard, held_bytes + shard * p[1], units.get(unit, 0) + shard * p[1]
        if len(p) < 4 or p[3]:
            taught = [taught[0] + count, taught[1] + count * p[1], taught[2] + shard, taught[3] + shard * p[1]]
    return ParamSums(dp, whole, whole_bytes, held, held_bytes, tuple(units.items()), tuple(taught))


def footprint(
    params: list[tuple] | ParamSums, *, dp: int = 1, sharding: str = "full", split: bool = False,
    reduce: str = "step", compute_bytes: int | None = None,
) -> Footprint:
    """One rank's parameter memory for one data-parallel sharding.

    Args:
        params: (shape on this rank after tensor parallelism, bytes per element[, unit[, trained]])
            of each parameter the rank holds, each once; `unit` names the FSDP2 unit it
            belongs to (a decoder layer, or the root), default one unit for all; `trained` (default
            True) whether it has a gradient and AdamW state (a LoRA plan's frozen weights have neither). Or their
            `param_sums` for this dp, which a search sizes once for every sharding.
        dp: data-parallel replicas; 1 shares nothing (the sharding is then ignored).
        sharding: `full`, `grad_op` or `replicate` (`data_parallel.sharding`).
        split: the schedule splits backwards (zero-bubble, zbv): `full` then keeps
            parameters gathered through the step, as `grad_op` does.
        reduce: `step` or `microbatch` (`data_parallel.reduce`): under `full` and `grad_op`,
            whether the rank's whole gradients wait for the step's one reduce, or only the root's
            and one layer's are whole at a time, beside the reduced shards they accumulate into.
        compute_bytes: bytes per element of the compute dtype when it is narrower than the
            parameters' (mixed precision, `apply_plan(compute_dtype=)`); None computes in theirs. Where
            dp shards, FSDP2 gathers the parameters in it (gradients still accumulate and reduce
            in the parameters' dtype); elsewhere autocast keeps a copy of each weight in it
            through the step.

    Returns:
        A `Footprint`. The peak, with dp = 1: weights + gradients + AdamW. With dp > 1:
        weights + AdamW held + gathered parameters (padded) + the rank's whole gradients,
        accumulated until the one reduce per step (under `reduce: microbatch`, the reduced
        shards + the root's and the largest layer's whole gradients). Gathered: under `full` the root unit
        (`"root"`: kept from its forward to its backward, as torch's FSDP2 keeps a root) and
        the largest other unit (each let go after its forward and after its backward); under `grad_op` (or
        `full` with split backwards) all of the rank's, kept from forward to the step's
        end. Sharded gradients of the previous step are assumed freed (`zero_grad()`).

    Example:
        >>> footprint([((3, 4), 4)], dp=2).params   # 3 rows padded to 4, 2 per rank
        8
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"data_parallel.sharding {sharding!r}: use one of {', '.join(SHARDINGS)}")
    z = params if isinstance(params, ParamSums) else param_sums(params, dp)
    if z.dp != dp:
        raise ValueError(f"parameter sums made for dp {z.dp}, asked for dp {dp}")
    whole, whole_bytes = z.whole, z.whole_bytes
    t_whole, t_bytes, t_held, t_held_bytes = z.taught  # what has gradients and AdamW state
    mixed = compute_bytes is not None and compute_bytes * whole < whole_bytes
    if dp == 1 or sharding == "replicate":
        gathered = whole_bytes if dp > 1 else 0  # replicate's second copy: DDP's buckets, or FSDP2's gathered one
        cast = compute_bytes * whole if mixed else 0  # autocast's cached casts of the weights
        return Footprint(whole, whole_bytes, t_bytes, ADAMW_BYTES * t_whole,
                         whole_bytes + t_bytes + ADAMW_BYTES * t_whole + gathered + cast)
    if reduce not in REDUCES:
        raise ValueError(f"data_parallel.reduce {reduce!r}: use one of {', '.join(REDUCES)}")
    held, held_bytes = z.held, z.held_bytes
    units = dict(z.unit_bytes)
    root = units.pop("root", 0)
    one_at_a_time = dp * (root + max(units.values(), default=0))  # the root and the largest layer, whole
    gathered = one_at_a_time if sharding == "full" and not split else dp * held_bytes
    if mixed and held_bytes:  # FSDP2 gathers in the compute dtype
        gathered = gathered * compute_bytes * held // held_bytes
    # The root's whole gradients live through each backward (its unit reduces when the backward ends).
    share = t_held_bytes / held_bytes if held_bytes else 1.0  # of a unit's gradients, the trained part
    grads = t_held_bytes + int(share * one_at_a_time) if reduce == "microbatch" else t_bytes
    return Footprint(held, held_bytes, t_held_bytes, ADAMW_BYTES * t_held,
                     held_bytes + ADAMW_BYTES * t_held + gathered + grads)


def reduce_as_run(reduce: str, *, microbatches: int, virtual_stages: int, split: bool) -> str:
    """The gradient reduction a step makes under `data_parallel.reduce`: `step` with one whole backward
    on a rank (one microbatch, one stage a rank, no split backward) reduces each unit as that backward
    leaves it (the runner arms the sync before a step's last backward), which is `microbatch`'s memory."""
    alone = microbatches == 1 and virtual_stages == 1 and not split
    return "microbatch" if reduce == "step" and alone else reduce


def rank_parameters(resolved: ResolvedPlan, model: nn.Module, pp_rank: int, *, by_expert: bool = False
                    ) -> list[tuple[tuple[int, ...], int, str]]:
    """(shape on the rank, bytes per element, FSDP2 unit, trained) of every parameter pp rank `pp_rank` holds, each
    once (trained: with gradients and AdamW state; under a LoRA plan only the adapters).

    Every tp rank of a stage holds the same shapes; a parameter shared by two modules
    the rank holds (tied embeddings on one rank) counts once. The unit is the decoder
    layer (a traced model: the module of its layer sequence) holding it, else "root".
    `by_expert`: only the experts split over ep (a rank's E / ep, which FSDP2 leaves whole),
    else all the others.
    """
    layers = frozenset(m for s in resolved.stages for m in s.layers)
    held = rank_held(resolved, pp_rank) if all(s.held or not s.param_count for s in resolved.stages) else None
    if held is None:  # a ResolvedPlan built by hand, without its stages' parameters
        modules = resolved.rank_modules(pp_rank) if resolved.pp > 1 else ("",)
        held = held_parameters(model, modules, resolved.shards)
    return [(p.shape, p.element_size, param_unit(p.name, layers), p.trained) for p in held if p.by_expert == by_expert]


@functools.lru_cache(maxsize=1 << 16)  # a plan search asks for the same names under the same layers often
def param_unit(name: str, layers: frozenset[str]) -> str:
    """The FSDP2 unit a parameter belongs to: the decoder layer holding it, else "root"."""
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in layers), "root")


def rank_held(resolved: ResolvedPlan, pp_rank: int) -> list:
    """The parameters (`HeldParameter`) the stages of `pp_rank` hold, a parameter two of them share once."""
    seen, out = set(), []
    for s in resolved.rank_stages(pp_rank):
        for p in resolved.stages[s].held:
            if p.ident not in seen:
                seen.add(p.ident)
                out.append(p)
    return out


def rank_footprints(resolved: ResolvedPlan, model: nn.Module | None = None, *, sharding: str | None = None,
                    reduce: str | None = None, dtype: str | torch.dtype | None = None) -> list[Footprint]:
    """Each pp rank's footprint, in pp-rank order; every tp rank and every replica alike.

    Args:
        resolved: `rewrite.resolve(plan, model)`.
        model: the model it was resolved against (a meta-device one will do); needed
            when mesh.dp > 1, for FSDP2's padding. Without it (dp = 1) the stages'
            totals are used.
        sharding: another mode than the plan's `data_parallel.sharding`, to compare.
        reduce: another than the plan's `data_parallel.reduce`, to compare (either as the step
            runs it: `reduce_as_run`).
        dtype: the compute dtype, when narrower than the parameters' (`footprint`'s compute_bytes).

    Raises:
        ValueError: mesh.dp > 1 and no model, or a dtype that is not a floating one.
    """
    mesh, sharding, pipe = resolved.plan.mesh, sharding or resolved.plan.data_parallel.sharding, resolved.plan.pipeline
    dp = mesh.dp * mesh.cp  # the ranks sharing the parameters: replicas times the cp ranks
    split = splits_backward(pipe.schedule, pipe.table)
    reduce = reduce_as_run(reduce or resolved.plan.data_parallel.reduce, microbatches=pipe.microbatches,
                           virtual_stages=pipe.virtual_stages, split=split)
    compute = None if dtype is None else compute_dtype(model, dtype).itemsize
    if model is not None:
        # Experts split over ep are whole on each rank (weights, gradients and AdamW state), never gathered;
        # in mixed precision each computes in a cast copy of its weights, as autocast's.
        return [footprint(rank_parameters(resolved, model, r), dp=dp, sharding=sharding, split=split, reduce=reduce,
                          compute_bytes=compute)
                + footprint(rank_parameters(resolved, model, r, by_expert=True), compute_bytes=compute)
                for r in range(resolved.pp)]
    if dp > 1:
        raise ValueError(
            f"memory per rank with {dp} ranks sharing the parameters (mesh.dp={mesh.dp} x mesh.cp={mesh.cp}) needs "
            "the parameters' shapes (FSDP2 pads each one's dim 0 to a multiple of dp x cp): pass the model the plan "
            "was resolved against, e.g. format_plan(resolved, model=model)"
        )
    out = []
    for r in range(resolved.pp):
        stages = [resolved.stages[s] for s in resolved.rank_stages(r)]
        count, nbytes = sum(s.param_count for s in stages), sum(s.param_bytes for s in stages)
        trained = [p for s in stages for p in s.held if p.trained] if resolved.plan.lora is not None else None
        taught = None if trained is None else (sum(p.numel for p in trained), sum(p.nbytes for p in trained)) * 2
        out.append(footprint(ParamSums(1, count, nbytes, count, nbytes, (), taught), compute_bytes=compute))
    return out
