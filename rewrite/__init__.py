"""rewrite: declarative tensor- and pipeline-parallel rewriting of PyTorch models.

Write a plan, apply it, train:

    >>> import rewrite
    >>> stage = rewrite.apply_plan(model, "plans/llama-tp2-pp2.yaml")   # on every rank
    >>> loss = rewrite.run_schedule(stage, *rewrite.microbatches(ids, 4))

Every refusal is a `rewrite.RewriteError` naming the fix; docs/api.md lists this API.
"""

import gc

# torch, transformers and pydantic make about a million long-lived objects as they load: the collector's
# full passes over them meanwhile find nothing to free and cost ~0.5 s of the import.
_collecting = gc.isenabled()
gc.disable()
from .checkpoint.hf_load import from_pretrained
from .checkpoint.export import export_checkpoint
from .checkpoint.hf_save import save_pretrained
from .checkpoint.training_state import latest_checkpoint, load_training_state, save_training_state
from .estimate.hardware import Hardware, load_hardware
from .estimate.search import Candidate, NoPlanFits, suggest_plans
from .errors import CheckpointError, CheckpointWriteError, InputError, RewriteError
from .estimate.memory import RankMemory, rank_memory
from .estimate.step_time import StepPrediction, predict_step
from .pipeline.batches import microbatches
from .pipeline.grad_norm import clip_grad_norm_
from .pipeline.loss import LogitShard, returns_token_sums, takes_logit_shards
from .pipeline.runner import causal_lm_loss, run_schedule
from .pipeline.stage import Stage, TimelineEvent
from .pipeline.timeline import gather_timeline, plot_timeline
from .plan.from_hf import plan_from_hf
from .binding.resolve import ResolvedPlan, StageSpec, resolve
from .plan.loading import load_plan
from .plan.schema import MeshSpec, ParallelPlan, PlanError
from .binding.tp_rules import ShardSpec
from .rewriter import apply_plan
from .lora import LoraLinear, put_adapters
from .run.launch import LaunchError, launch
from .tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .tensor_parallel.loss import vocab_parallel_cross_entropy
from .tensor_parallel.vocab import VocabParallelEmbedding
from .train_step import train_step_pipeline_afab

if _collecting:
    gc.enable()

__all__ = [
    # a plan
    "ParallelPlan", "MeshSpec", "load_plan", "plan_from_hf", "resolve", "ResolvedPlan", "StageSpec", "ShardSpec",
    # applying it, running steps
    "apply_plan", "Stage", "microbatches", "run_schedule", "causal_lm_loss", "returns_token_sums", "takes_logit_shards",
    "LogitShard", "clip_grad_norm_", "TimelineEvent", "gather_timeline", "plot_timeline",
    # low-rank adapters
    "LoraLinear", "put_adapters",
    # checkpoints
    "from_pretrained", "save_pretrained", "save_training_state", "load_training_state", "latest_checkpoint",
    "export_checkpoint",
    # numbers and the planner
    "rank_memory", "RankMemory", "predict_step", "StepPrediction", "suggest_plans", "Candidate", "Hardware",
    "load_hardware",
    # processes
    "launch",
    # refusals
    "RewriteError", "PlanError", "InputError", "CheckpointError", "CheckpointWriteError", "NoPlanFits", "LaunchError",
    # the layers and the seed contracts
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "train_step_pipeline_afab",
]
__version__ = "0.1.0"

# Names earlier releases exported, removed: what to use instead.
_REMOVED = {
    "run_afab": "use rewrite.run_schedule, which runs the plan's pipeline.schedule (afab unless the plan names another)",
    **dict.fromkeys(("Mesh", "build_mesh"), "apply_plan builds the mesh; a stage's is stage.mesh"),
}


def __getattr__(name: str):
    advice = f" (removed: {_REMOVED[name]})" if name in _REMOVED else ""
    raise AttributeError(f"module 'rewrite' has no attribute {name!r}{advice}")
