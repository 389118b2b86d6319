"""What a plan binds to on a model: `resolve` (stages, tensor-parallel rules and their shapes),
where each rank's part of a tensor lies (`shard_layout`), stage cuts, the walk over a rank's
parameters.

Pure, like `rewrite.plan` below it: no process group, so a plan binds to a meta-device model.
"""

from .resolve import ResolvedPlan, StageSpec, resolve
from .tp_rules import ShardSpec

__all__ = ["resolve", "ResolvedPlan", "StageSpec", "ShardSpec"]
