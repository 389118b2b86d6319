"""The plan search: every valid (dp, pp, cp, tp), schedule, microbatch count, sharding and switch,
the ones whose busiest rank fits the device memory, ranked by predicted step time.

For each mesh (tp within a node, cp where 2 cp chunks split the sequence, each layout `resolve`
accepts) and each choice of
vocab + loss parallelism and sequence parallelism the plan is bound once (`auto` cuts, per
virtual-stage count; for a mixture of experts computed in its parameters' dtype, per ep dividing
dp x tp and the experts: the best of each mesh may split its experts); schedules, microbatch counts, data-parallel sharding and activation
checkpointing (off, selective where it is estimated, every other layer, every layer) vary on that binding. Each candidate's
memory is `estimate.memory.rank_memory`'s, its time `estimate.step_time.predict_step`'s.
Checkpointing only adds time, so a candidate takes the least of it that fits.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..errors import RewriteError
from ..binding.resolve import resolve
from ..models.hf_decoder import meta_model
from ..plan.loading import load_plan
from ..values import is_count
from .activations import compute_dtype
from .hardware import Hardware, default_dtype, load_hardware
from .memory import GIB, rank_memory
from .mesh_search import Candidate, best_per_mesh
from .search_space import collector_paused

__all__ = ["Candidate", "NoPlanFits", "suggest_plans", "check_arguments"]


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

    return meta_model(model_or_config, dtype=torch.float32)


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
    lora: dict | None = None,
    compiled: bool | None = None,
) -> list[Candidate]:
    """The plans that fit, fastest first by predicted step time: the best of each (dp, pp, cp, tp).

    Args:
        model_or_config: a transformers causal LM (meta will do) or its config.
        world: devices.
        device_memory: GiB per device (default: the profile's memory_gib). A plan fits when its busiest
            rank's estimated peak is within what a device leaves to tensors: this, less the profile's
            `memory_reserve_gib` and `fragmentation` (`Hardware.usable_gib`).
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
        lora: a plan's `lora` section (`{"rank": 16}`): every candidate trains LoRA adapters with the other
            weights frozen (gradients and AdamW state for the adapters only, no weight gradients for the
            frozen layers; docs/lora.md).
        compiled: every plan compiled (`compile: true`: each block under torch.compile) or none (False); None
            (default): each both ways where the profile holds measured compiled terms (`Hardware.compiled`,
            `rewrite calibrate`), the faster kept, else eager.

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
    if device_memory is not None and device_memory <= hw.memory_reserve_gib:
        raise ValueError(f"`device_memory` is {device_memory:g} GiB, within the {hw.memory_reserve_gib:g} GiB that "
                         f"{hw.name}'s profile reserves for the runtime; use more (memory_reserve_gib in the profile)")
    limit = hw.usable_gib(device_memory) * GIB
    batch = global_batch or 4 * world
    with collector_paused():
        best = best_per_mesh(model, hw, world=world, G=G, limit=limit, seq_len=seq_len, batch=batch, timed=True,
                             dtype=dtype, max_cp=max_cp, lora=lora,
                             compiled=compiled if compiled is not None or hw.compiled is not None else False)
        if not best:
            raise NoPlanFits(
                f"no plan fits: no layout of {world} device(s) with {hw.usable_text(device_memory)} each holds "
                f"{type(model).__name__} at {seq_len} tokens x {batch} sequences",
                _advice(model, hw, world=world, G=G, limit=limit, seq_len=seq_len, batch=batch, dtype=dtype,
                        max_cp=max_cp, lora=lora),
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


def _advice(model, hw, *, world, G, limit, seq_len, batch, dtype, max_cp, lora) -> str:
    """What would fit: the sequence length on this world, else the smallest world (doubling, up to 64x)."""
    fits = lambda **kw: bool(best_per_mesh(model, hw, G=G, limit=limit, timed=False, frugal=True,  # noqa: E731
                                           dtype=dtype, max_cp=max_cp, lora=lora, **kw))
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
