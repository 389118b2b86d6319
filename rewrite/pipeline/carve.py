"""Carving this rank's pipeline stages out of a model, in place.

A rank holds one stage, or several with `pipeline.virtual_stages` (looped or V
placement, from the resolved plan). HF LLaMA-family models keep their own module
objects at their original paths (the layer list becomes a `ModuleDict` keyed by
original index); other modules get one fx `GraphModule` per stage over the model's
own submodules. Everything this rank's stages do not run is released.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import fx, nn

from ..mesh import Mesh
from ..lent import lend
from ..models import fx_graph
from ..models.hf_decoder import run_backbone
from ..binding.resolve import ResolvedPlan
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.sequence_model import sequence_state
from .loss import LogitShard
from .stage import Stage

__all__ = ["carve_stage", "carve_unused"]


def carve_stage(model: nn.Module, resolved: ResolvedPlan, mesh: Mesh) -> Stage:
    """Keep only this rank's stages in `model` (in place); returns the `Stage` of what was kept."""
    if resolved.backbone is not None:
        return _carve_hf(model, resolved, mesh)
    ids = resolved.rank_stages(mesh.pp_rank)
    if resolved.num_stages == 1:
        return Stage(model=model, module=model, resolved=resolved, mesh=mesh, forward_fns={0: model})
    traced = fx_graph.trace(model, leaf_types=(ColumnParallelLinear, RowParallelLinear))
    graphs = {s: fx_graph.stage_graph(traced, list(resolved.cut_points), s) for s in ids}
    carve_unused(model, set().union(*(fx_graph.used_targets(g) for g in graphs.values())))
    # GraphModules over the model's own submodules, at their original paths.
    modules = {s: fx.GraphModule(model, g, class_name=f"{type(model).__name__}Stage") for s, g in graphs.items()}
    # One stage: its GraphModule holds exactly this rank's parameters; several: the carved model does.
    module = modules[ids[0]] if len(ids) == 1 else model
    return Stage(model=model, module=module, resolved=resolved, mesh=mesh, forward_fns=modules)


def _carve_hf(model: nn.Module, resolved: ResolvedPlan, mesh: Mesh) -> Stage:
    bb, ids, last_id = resolved.backbone, resolved.rank_stages(mesh.pp_rank), resolved.num_stages - 1
    first, last = 0 in ids, last_id in ids
    indices = sorted(i for s in ids for i in resolved.layer_indices[s])
    tied_weight = None
    if bb.head and model.get_submodule(bb.head).weight is model.get_submodule(bb.embed).weight:
        tied_weight = model.get_submodule(bb.embed).weight
    if mesh.pp > 1:
        # Keep the original layer objects under their original indices; drop the rest.
        layers = model.get_submodule(bb.layers)
        _replace(model, bb.layers, nn.ModuleDict({str(i): layers[i] for i in indices}))
        if not first:
            for name in (bb.embed, *bb.after_embed):
                _replace(model, name, None)
        if not last:
            if not (first and bb.norm_first):  # NanoChat's first stage runs the final norm too
                _replace(model, bb.norm, None)
            if bb.head:
                _replace(model, bb.head, None)
    tied = []
    if tied_weight is not None and first != last:
        # Each end holds a copy of the shared matrix: start them equal, sum their grads.
        # (A meta-device model has no values yet: whoever materialises it loads both.)
        if not tied_weight.is_meta:
            data = tied_weight.data  # a new tensor object: lent, so gloo can let it go at exit
            dist.broadcast(data, src=mesh.rank_at(pp=0), group=mesh.tied_group)
            lend(data)
        tied = [tied_weight]
    head, shard = None, None
    if last and resolved.plan.loss_parallel and isinstance(getattr(model, "lm_head", None), ColumnParallelLinear):
        head = model.lm_head  # the runner's loss takes this rank's vocabulary shard of the logits
        start = head.tp_rank * head.per_rank
        shard = LogitShard(start, start + head.per_rank, head.out_features, head.group)
    forward_fns = {s: _StageForward(model, resolved, s, head) for s in ids}
    return Stage(model=model, module=model, resolved=resolved, mesh=mesh, forward_fns=forward_fns, tied=tied,
                 logit_shard=shard)


def _replace(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


class _StageForward:
    """Runs one stage of an HF backbone on a microbatch: `fn(x, seq_len=None, position_ids=None, sequence_shard=None)`."""

    def __init__(self, model: nn.Module, resolved: ResolvedPlan, stage_id: int, head: ColumnParallelLinear | None):
        self.model, self.bb, self.stage_id = model, resolved.backbone, stage_id
        self.layers = list(resolved.layer_indices[stage_id])
        self.first, self.last = stage_id == 0, stage_id == resolved.num_stages - 1
        self.head = head.forward_shard if head is not None and self.last else None
        self.sequence = sequence_state(model)

    def __call__(self, x, *, seq_len: int | None = None, position_ids=None, sequence_shard=None):
        if self.sequence is not None:
            if not self.first and seq_len is None:
                raise ValueError(
                    f"stage {self.stage_id} receives sequence shards (sequence_parallel): pass the full "
                    "sequence length, stage.run(stage_id, x, seq_len=...)"
                )
            self.sequence.length = x.shape[1] if self.first else seq_len
        return run_backbone(
            self.model, self.bb, x, self.layers, first=self.first, last=self.last, seq_len=seq_len, head=self.head,
            position_ids=position_ids,
            layer_kwargs=None if sequence_shard is None else {"sequence_shard": sequence_shard},
        )


def carve_unused(model: nn.Module, keep: set[str]) -> None:
    """Remove, in place, every submodule, parameter and buffer no path in `keep` needs."""

    def join(path: str, name: str) -> str:
        return f"{path}.{name}" if path else name

    def needed(path: str) -> bool:
        return any(k == path or k.startswith(path + ".") or path.startswith(k + ".") for k in keep)

    def walk(module: nn.Module, path: str) -> None:
        if path in keep:
            return  # a module a stage calls keeps everything it holds
        for name in [*module._parameters, *module._buffers]:
            if join(path, name) not in keep:
                module._parameters.pop(name, None)
                module._buffers.pop(name, None)
        for name, child in list(module._modules.items()):
            if child is None or not needed(join(path, name)):
                delattr(module, name)
            else:
                walk(child, join(path, name))

    walk(model, "")
