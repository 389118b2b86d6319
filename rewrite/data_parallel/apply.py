"""Data parallelism: this rank's stages sharded or replicated over dp x cp.

Each decoder layer (each module of a traced model's layer sequence) becomes one FSDP2 unit, the model
the root unit holding the rest: `fully_shard` for `full` and `grad_op`, FSDP2's `replicate` for
`replicate` where DDP does not fit (`DdpSync`). A stage runs through a model method registered with FSDP
(`register_fsdp_forward_method`), so the root gathers its parameters as `model(...)` would. Gradients
are reduced once per step (`reduce: step`, as torch.distributed.pipelining does) or per microbatch.
"""

from __future__ import annotations

import types

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from ..agreement import agree
from ..grad_finish import GradFinish
from ..torch_internals import ddp_ignore, ddp_reducer_finished, finish_fsdp_backward, prepare_ddp_for_backward, replicate
from ..models.names import first_names
from ..schedules import last_backward_reaches_all
from ..pipeline.stage import Stage
from ..binding.resolve import ResolvedPlan

__all__ = ["DdpSync", "GradSync", "apply_data_parallel", "data_parallel_units"]

_RUN = "_rewrite_run_stage"  # the model method a stage runs through, registered with FSDP
_DOING = "the data-parallel gradient reduce over {}"  # GradFinish.doing


class GradSync(GradFinish):
    """Switches a rank's data-parallel units between accumulating and synchronising gradients."""

    def __init__(self, root: nn.Module, sharding: str, *, reshard_after_backward: bool, over: str = "dp"):
        self.root, self.sharding, self.reshard = root, sharding, reshard_after_backward
        self.doing = _DOING.format(over)

    def begin(self) -> None:
        """Every backward of the step accumulates local gradients. `full` (without split backwards) lets each
        unit's gathered parameters go after its backward, as ZeRO-3 does; `grad_op`, `replicate` and split
        schedules keep them until the step's end (no gathering again for the next microbatch; W needs them)."""
        self.root.set_is_last_backward(False)
        self.root.set_reshard_after_backward(self.reshard)
        self.root.set_requires_gradient_sync(False)

    def next_backward_reduces(self) -> None:
        """The next backward reduces: each unit as its own backward ends, overlapping the rest of that backward.
        Not for split backwards: their W comes later."""
        self.root.set_is_last_backward(True)
        self.root.set_requires_gradient_sync(True)

    def finish(self) -> None:
        """Reduce the step's gradients over dp (averaged), once, and reshard what was gathered."""
        self.root.set_is_last_backward(True)
        self.root.set_reshard_after_backward(True)
        self.root.set_requires_gradient_sync(True)
        finish_fsdp_backward(self.root, replicated=self.sharding == "replicate")


class DdpSync(GradFinish):
    """`sharding: replicate` on torch's DDP: one bucketed all-reduce per step, overlapped with the backward.

    Why DDP: it starts each bucket's all-reduce as soon as the bucket fills, beside the rest of the
    backward; FSDP2's `replicate` reduces unit by unit, and on a CPU backend each reduction waits for
    itself. Driven as torch.distributed.pipelining drives its DDP stages (every backward but the last
    accumulates, as in `no_sync`), never through DDP's `forward`; built at the first step, once the
    parameters have storage (a model loaded from a checkpoint is rewritten on meta).
    """

    def __init__(self, module: nn.Module, group: ProcessGroup, *, ignore: list[str] = (), over: str = "dp"):
        self.module, self.group, self.ignore = module, group, list(ignore)  # ignore: parameter names DDP leaves alone
        self.doing = _DOING.format(over)
        self.ddp: DistributedDataParallel | None = None
        self.armed = False

    def begin(self) -> None:
        """Every backward of the step accumulates. The first call builds DDP: collective over the dp group
        (DDP checks the replicas' shapes and starts them from dp rank 0's values)."""
        if self.ddp is None:
            if self.ignore:
                ddp_ignore(self.module, self.ignore)
            self.ddp = DistributedDataParallel(self.module, process_group=self.group, forward_sync_buffers=False)
        self.ddp.require_backward_grad_sync = False
        self.armed = False

    def next_backward_reduces(self) -> None:
        """The next backward is the step's last: DDP all-reduces each bucket as it fills."""
        self.ddp.require_backward_grad_sync = True
        prepare_ddp_for_backward(self.ddp)
        self.armed = True

    def finish(self) -> None:
        """Check that the last backward reduced every bucket (DDP averaged them over dp)."""
        if not self.armed:
            raise RuntimeError("replicate on DDP: the step had no whole last backward to reduce in")
        self.armed = False
        if not ddp_reducer_finished(self.ddp):
            missing = [n for n, p in self.module.named_parameters()
                       if p.requires_grad and p.grad is None and n not in self.ignore]
            raise RuntimeError(
                "data_parallel.sharding replicate: the step's last backward did not reach every trainable "
                f"parameter ({', '.join(missing[:4]) or 'some of them'}), so their gradients were not averaged "
                "over the replicas; freeze parameters the model does not use (requires_grad_(False))"
            )


def data_parallel_units(model: nn.Module, resolved: ResolvedPlan, stage_ids: list[int]) -> list[nn.Module]:
    """The modules that each become one FSDP2 unit on this rank (stages `stage_ids`), below the root (the model)."""
    bb = resolved.backbone
    if bb is None:
        names = dict.fromkeys(m for s in stage_ids for m in resolved.stages[s].modules)
        modules = [model.get_submodule(n) for n in names]
        return [m for m in modules if m is not model and any(True for _ in m.parameters())]
    layers = model.get_submodule(bb.layers)
    held = sorted(i for s in stage_ids for i in resolved.layer_indices[s])
    return [layers[str(i)] if isinstance(layers, nn.ModuleDict) else layers[i] for i in held]


def _loose_parameters(stage: Stage, units: list[nn.Module]) -> list[str]:
    """Parameters of a traced stage outside every unit: its graph reads them directly."""
    if stage.resolved.backbone is not None or stage.module is stage.model:
        return []  # the root unit gathers them where the model's own modules read them
    covered = {id(p) for unit in units for p in unit.parameters()}
    return [n for n, p in stage.model.named_parameters() if id(p) not in covered]


def apply_data_parallel(
    stage: Stage, *, split_backward: bool, ignored: list[nn.Parameter] = (),
) -> GradSync | DdpSync | None:
    """Shard (or replicate) this rank's modules over dp, in place.

    Args:
        stage: what `carve_stage` kept on this rank (activation checkpointing applied; `precision` set:
            with `by="fsdp"`, units gather in the compute dtype and reduce in the master dtype).
        split_backward: the schedule splits backwards into B and W, which need the forward's parameters
            until W: `full` then keeps them gathered from forward to backward, as `grad_op` does.
        ignored: parameters left whole and unreduced (experts split over ep, reduced by `expert_parallel`).

    Returns:
        The step's data-parallel `GradFinish`, having pointed `stage.forward_fns` and `stage.tied` at what
        FSDP2 put in place; None with dp x cp = 1. `replicate` on one stage per rank with whole backwards:
        torch's DDP, built at the first step (`DdpSync`).
    """
    resolved, mesh, precision = stage.resolved, stage.mesh, stage.precision
    if mesh.replicas == 1:
        return None
    sharding = resolved.plan.data_parallel.sharding
    over = "dp x cp" if mesh.cp > 1 else "dp"
    # DDP fits where the step's last backward reaches every parameter (the step model prices it alike).
    if sharding == "replicate" and last_backward_reaches_all(len(stage.forward_fns), split_backward):
        names = first_names(stage.module)
        return DdpSync(stage.module, mesh.replica_mesh.get_group(), ignore=[names[id(p)] for p in ignored], over=over)
    units = data_parallel_units(stage.model, resolved, sorted(stage.forward_fns))
    loose = _loose_parameters(stage, units)
    agree(
        [f"data parallelism shards the modules of a traced model's layer sequence, but its forward reads "
         f"parameters outside them ({', '.join(loose[:4])}); move them into a submodule the model calls"]
        if loose else [],
        "apply_plan",
    )
    dp_mesh, model = mesh.replica_mesh, stage.model  # the dp replicas, times the cp ranks
    zero3 = sharding == "full" and not split_backward  # gathered for each use, let go after it
    names = first_names(model)
    policy = MixedPrecisionPolicy()
    if precision is not None and precision.by == "fsdp":
        policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=precision.master)
    tied = [names[id(p)] for p in stage.tied]
    left = set(ignored) or None
    for module in [*units, model]:  # the root last
        if sharding == "replicate":
            replicate(module, mesh=dp_mesh, ignored_params=left)
        else:
            # The root's parameters are needed again by the backward right after the forward:
            # kept gathered in between, as fully_shard does for a root by default.
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero3 and module is not model, mp_policy=policy,
                        ignored_params=left)
    forward_fns = stage.forward_fns
    if any(fn is not model for fn in forward_fns.values()):
        fns = dict(forward_fns)
        setattr(model, _RUN, types.MethodType(lambda self, s, x, **kw: fns[s](x, **kw), model))
        register_fsdp_forward_method(model, _RUN)
        run = getattr(model, _RUN)
        forward_fns = {s: (fn if fn is model else _bind(run, s)) for s, fn in fns.items()}
    # FSDP2 put sharded parameters in the tied ones' place
    stage.forward_fns, stage.tied = forward_fns, [model.get_parameter(n) for n in tied]
    return GradSync(model, sharding, reshard_after_backward=zero3, over=over)


def _bind(run, s: int):
    return lambda x, **kw: run(s, x, **kw)
