"""Applying a plan: in-place module surgery on every rank (`apply_plan`), and the recomputation it wraps
around modules; docs/architecture.md walks through its order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .compiled import apply_compile
from .agreement import describe_ranks, raise_problems, ranks_by_value, share
from .context_parallel.attention import NAME as CONTEXT_PARALLEL, register as register_context_parallel
from .context_parallel.family import context_parallel_problem
from .data_parallel import apply_data_parallel
from .expert_parallel import ExpertSums, RouterLoss, apply_expert_parallel, expert_parameters
from .lora import apply_lora
from .models.names import first_names
from .models.router_loss import router_loss_parts
from .mesh import build_mesh, check_world
from .pipeline.carve import carve_stage
from .pipeline.param_splits import apply_param_splits
from .pipeline.stage import Stage, precision_for
from .pipeline.tied import TiedSums
from .binding.resolve import APPLIED, ResolvedPlan, resolve
from .plan.schema import ParallelPlan, PlanError
from .plan.loading import load_plan_for
from .tensor_parallel.partial_grads import StepSums
from .schedules import splits_backward
from .tensor_parallel.apply import apply_tensor_parallel
from .tensor_parallel.layers import RowParallelLinear
from .tensor_parallel.sequence_model import sequence_state
from .errors import InputError

__all__ = ["apply_plan"]


def apply_plan(model: nn.Module, plan: ParallelPlan | str | Path | dict, *,
               compute_dtype: torch.dtype | None = None) -> Stage:
    """Rewrite `model` in place for this rank and return its `Stage`.

    Collective: every rank of the default process group calls it with the same model (same weights) and
    plan. Global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank. With dp x cp > 1 each
    replica's modules are sharded (or replicated) over the dp x cp ranks holding them with torch FSDP2
    (`data_parallel.sharding`). With cp > 1 the attention runs on sequence shards (`rewrite.context_parallel`).

    Args:
        model: a Hugging Face LLaMA-family model, or any module torch.fx can trace (the fx path is only
            needed when pp > 1). Not yet rewritten.
        plan: a `ParallelPlan`, or a path / dict for `load_plan`.
        compute_dtype: compute in this dtype (torch.bfloat16) over the model's float32 parameters, which
            stay the master weights: where dp shards them FSDP2 gathers them in it and reduces gradients in
            float32, else `run_schedule` runs each forward under `torch.autocast`. None: the parameters'.

    Returns:
        This rank's `Stage`. With pp == 1 `stage.model` is still a complete model (`model(input_ids=...)`,
        `model.generate(...)` work on every rank).

    Raises:
        ValueError: no process group, a world size other than dp * pp * cp * tp, any problem `resolve`
            finds, a compute_dtype wider than the parameters', a model already rewritten, or ranks given
            different plans, models or weights. Raised on every rank alike, after one collective on the
            default group and before any other; the model is left untouched.

    Example:
        >>> dist.init_process_group("gloo")          # under torchrun, 2 processes
        >>> stage = apply_plan(model, "plans/llama-tp2.yaml")
        >>> logits = model(input_ids=ids).logits     # same as before, on every rank
    """
    resolved, error, precision = None, None, None
    try:
        plan = load_plan_for(plan, model)
        check_world(plan.mesh.shape)
        resolved = resolve(plan, model, world_size=dist.get_world_size())
        if plan.mesh.cp > 1 and (problem := context_parallel_problem(model)):
            raise PlanError(plan.source, [f"{plan.where('mesh', 'cp')}mesh.cp={plan.mesh.cp}: {type(model).__name__}: "
                                          f"{problem}; use cp 1"])
        shards = plan.mesh.dp * plan.mesh.cp > 1 and plan.data_parallel.sharding != "replicate"
        precision = precision_for(compute_dtype, _floating_dtype(model), shards=shards)
    except (ValueError, TypeError) as exc:
        if not (dist.is_available() and dist.is_initialized()):
            raise  # no group: no peer is waiting
        error = exc
    _agree_on_binding(model, resolved, error)  # the first collective
    mesh = build_mesh(plan.mesh.shape, kv_replicas=resolved.kv_replicas)
    if mesh.cp > 1:
        register_context_parallel()
        model.set_attn_implementation(CONTEXT_PARALLEL)  # its layers call it; the stage passes each its shard
    apply_lora(model, resolved)  # on the whole model: the parallel layers take their slices of the adapters
    if mesh.tp > 1:
        apply_tensor_parallel(model, resolved, mesh.tp_group, kv_group=mesh.kv_group)
    # FSDP2 casts the weights it gathers, not the experts it leaves alone: those cast themselves.
    apply_expert_parallel(model, resolved, mesh, cast=precision.dtype if precision and precision.by == "fsdp" else None)
    parts = router_loss_parts(model)  # resolve refused what it cannot count: here a tuple or None
    router_loss = None if parts is None else RouterLoss(model, parts, cp_group=mesh.cp_group if mesh.cp > 1 else None,
                                                        sequence=sequence_state(model) if mesh.tp > 1 else None)
    stage = carve_stage(model, resolved, mesh)
    stage.precision, stage.router_loss = precision, router_loss
    stage.recomputed = tuple(apply_activation_checkpointing(model, resolved))  # inside FSDP2's units
    stage.compiled = apply_compile(model, resolved)  # around recomputation, inside FSDP2's hooks
    split = splits_backward(plan.pipeline.schedule, plan.pipeline.table)
    experts = expert_parameters(stage.module)
    dp_sync = apply_data_parallel(stage, split_backward=split, ignored=experts)
    names = first_names(stage.model)
    finishers = (dp_sync, ExpertSums(experts, mesh) if experts else None, StepSums(stage.module) or None,
                 TiedSums(stage.model, [names[id(p)] for p in stage.tied], mesh.tied_group) if stage.tied else None)
    stage.grad_finish = tuple(f for f in finishers if f is not None)
    setattr(model, APPLIED, f"a stage of {plan.source}")
    apply_param_splits(stage)  # after data parallelism: the parameters it put in place carry them
    return stage


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating parameter: its master weights' (default: torch's default)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _agree_on_binding(model: nn.Module, resolved: ResolvedPlan | None, error: BaseException | None) -> None:
    """Every rank must bind the same plan to the same model and weights, or stages would not fit: one
    collective carries each rank's error or view, then every rank raises the same error naming which differ."""
    view = None  # what must be equal on every rank, in words a user can compare
    if resolved is not None:
        plan = resolved.plan
        digest = hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:12]
        view = {"plan": f"{plan.source} ({plan.mesh.shape_text()}, digest {digest})",
                "world": f"{dist.get_world_size()} ranks, {dist.get_backend()} backend",
                "model": f"{resolved.model_name}, {resolved.total_params:,} parameters",
                "weights": weights_checksum(model)}
    gathered = share((None if error is None else str(error), view))
    errors = [e for e, _ in gathered]
    if error is not None and len(set(errors)) == 1:
        raise error  # every rank found the same problems
    raise_problems([[e] if e else [] for e in errors], "apply_plan")
    views = [v for _, v in gathered]
    by_key = {key: ranks_by_value([v[key] for v in views]) for key in views[0]}
    differ = [f"{key}: " + "; ".join(f"{describe_ranks(r)}: {v}" for v, r in groups.items())
              for key, groups in by_key.items() if len(groups) > 1]
    if differ:
        raise InputError(
            "apply_plan: ranks were given different plans, models or weights\n  "
            + "\n  ".join(differ)
            + "\n  pass the same plan and the same model (same seed or checkpoint) on every rank"
        )


def weights_checksum(model: nn.Module, *, samples: int = 256) -> str:
    """A cheap fingerprint of the weights: the exact bytes of up to `samples` evenly spaced values of each
    parameter. A model with tensors on the meta device (each rank fills in only what it will hold from a
    checkpoint) is not compared.
    """
    params = list(model.named_parameters())
    if any(param.is_meta for _, param in params):
        return "not compared: tensors on the meta device (values come from a checkpoint)"
    h = hashlib.sha256()
    for name, param in params:
        flat = param.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // samples)][:samples].contiguous()
        h.update(name.encode())
        h.update(picked.view(torch.uint8).cpu().numpy().tobytes())
    return f"checksum {h.hexdigest()[:12]}"


def apply_activation_checkpointing(model: nn.Module, resolved: ResolvedPlan) -> list[str]:
    """Wrap the forward of every module of `model` the plan's rules matched in torch's non-reentrant
    checkpoint (its inputs kept, its forward run again in the backward; under split backwards B recomputes,
    W reuses), op by op where the plan says 'selective' (`selective_policy`); returns their paths. The
    module's `forward` is wrapped in place, so hooks on the module (FSDP2's gathers, the tests' counters)
    stay outside the checkpointed region and run once per call."""
    done, selective = [], set(resolved.selective)
    for path in resolved.recomputed:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue  # carved away: another pipeline rank holds it
        if path in selective:
            for sub in module.modules():  # a kept product must not change: the row layers sum a copy
                if isinstance(sub, RowParallelLinear):
                    sub.sums_in_place = False
        module.forward = _checkpointed(module.forward, selective=path in selective)
        done.append(path)
    return done


def _checkpointed(forward, *, selective: bool):
    context = {"context_fn": selective_contexts} if selective else {}

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)

    run.__wrapped__ = forward
    return run


# Selective checkpointing keeps these outputs: the attention kernels' (recomputing them costs the most per
# byte) and every other matrix product's, counted from the first of each checkpointed call (torchtitan's
# default op-level policy; it counts `mm` alone, here `addmm` too, so that a layer with biases keeps alike).
_ATTENTION_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))
_PRODUCTS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))


def selective_contexts():
    """The forward and recompute contexts of one selectively checkpointed call: a fresh count of its
    products, the same in the forward and again in the recompute."""
    counts = {False: 0, True: 0}  # products seen so far, in the forward and in the recompute

    def policy(ctx, op, *args, **kwargs):
        if op in _PRODUCTS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in _ATTENTION_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
