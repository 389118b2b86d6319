"""rewrite: declarative tensor- and pipeline-parallel rewriting of PyTorch models.

Write a plan, apply it, train:

    >>> import rewrite
    >>> stage = rewrite.apply_plan(model, "plans/llama-tp2-pp2.yaml")   # on every rank
    >>> loss = rewrite.run_afab(stage, input_chunks, target_chunks)
"""

from .checkpoint import save_pretrained
from .checkpoint_load import from_pretrained
from .launch import LaunchError, launch
from .layers import ColumnParallelLinear, RowParallelLinear
from .hfplan import plan_from_hf
from .mesh import Mesh, build_mesh
from .plan import ParallelPlan, PlanError, load_plan
from .resolve import ResolvedPlan, ShardSpec, StageSpec, resolve
from .rewriter import apply_plan
from .schedule import causal_lm_loss, run_afab, train_step_pipeline_afab
from .stage import Stage, TimelineEvent

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelPlan",
    "PlanError",
    "load_plan",
    "plan_from_hf",
    "resolve",
    "ResolvedPlan",
    "ShardSpec",
    "StageSpec",
    "apply_plan",
    "Stage",
    "TimelineEvent",
    "Mesh",
    "build_mesh",
    "run_afab",
    "causal_lm_loss",
    "train_step_pipeline_afab",
    "save_pretrained",
    "from_pretrained",
    "launch",
    "LaunchError",
]
__version__ = "0.1.0"
