"""What a plan is and what it binds to: the schema, plan files, HF tp_plan import, binding to a model.

Pure: nothing here creates a process group or imports torch.distributed, so a plan
can be checked against a meta-device model on a laptop. Estimates of what a bound plan
costs are `rewrite.estimate`; drawing it is `rewrite.run.show`.
"""

from .from_hf import plan_from_hf
from .ranks import coordinates, global_rank
from .resolve import ResolvedPlan, StageSpec, resolve
from .loading import load_plan
from .schema import MeshSpec, ParallelPlan, PlanError
from .tp_rules import ShardSpec

__all__ = [
    "ParallelPlan", "MeshSpec", "PlanError", "load_plan", "plan_from_hf", "resolve", "ResolvedPlan", "StageSpec",
    "ShardSpec", "global_rank", "coordinates",
]
