"""What a plan is: the schema, plan files and their line numbers, loading, HF tp_plan import, module patterns.
Pure: no process group. Binding a plan to a model is `rewrite.binding`.
"""

from .from_hf import plan_from_hf
from .ranks import Coords, Shape
from .loading import load_plan
from .schema import MeshSpec, ParallelPlan, PlanError

__all__ = ["ParallelPlan", "MeshSpec", "PlanError", "load_plan", "plan_from_hf", "Coords", "Shape"]
