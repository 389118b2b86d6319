"""rewrite: declarative tensor- and pipeline-parallel rewriting of PyTorch models.

Write a plan, apply it, train:

    >>> import rewrite
    >>> stage = rewrite.apply_plan(model, "plans/llama-tp2-pp2.yaml")   # on every rank
    >>> loss = rewrite.run_afab(stage, input_chunks, target_chunks)
"""

from .checkpoint.hf_load import from_pretrained
from .checkpoint.export import export_checkpoint
from .checkpoint.hf_save import save_pretrained
from .checkpoint.training_state import latest_checkpoint, load_training_state, save_training_state
from .estimate.hardware import Hardware, load_hardware
from .estimate.search import Candidate, NoPlanFits, suggest_plans
from .estimate.step_time import StepPrediction, predict_step
from .mesh import Mesh, build_mesh
from .pipeline.batches import microbatches
from .pipeline.grad_norm import clip_grad_norm_
from .pipeline.loss import LogitShard, takes_logit_shards
from .pipeline.runner import causal_lm_loss, run_afab, run_schedule
from .pipeline.stage import Stage, TimelineEvent
from .plan.from_hf import plan_from_hf
from .plan.resolve import ResolvedPlan, StageSpec, resolve
from .plan.loading import load_plan
from .plan.schema import ParallelPlan, PlanError
from .plan.tp_rules import ShardSpec
from .rewriter import apply_plan
from .run.launch import LaunchError, launch
from .tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .tensor_parallel.loss import vocab_parallel_cross_entropy
from .tensor_parallel.vocab import VocabParallelEmbedding
from .train_step import train_step_pipeline_afab

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "takes_logit_shards",
    "LogitShard",
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
    "run_schedule",
    "causal_lm_loss",
    "microbatches",
    "clip_grad_norm_",
    "train_step_pipeline_afab",
    "save_pretrained",
    "from_pretrained",
    "save_training_state",
    "load_training_state",
    "latest_checkpoint",
    "export_checkpoint",
    "launch",
    "LaunchError",
    "suggest_plans",
    "Candidate",
    "NoPlanFits",
    "predict_step",
    "StepPrediction",
    "Hardware",
    "load_hardware",
]
__version__ = "0.1.0"
