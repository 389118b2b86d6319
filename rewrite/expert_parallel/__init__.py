"""Expert parallelism: a mixture of experts' fused experts split over mesh.ep, tokens dispatched to them
by all-to-all (`dispatch`), their gradients reduced over the ranks holding the same experts (`apply`).
Knows no pipeline: a stage's experts modules do their own exchanges inside its forward and backward."""

from .apply import ExpertSums, apply_expert_parallel, expert_parameters
from .aux_loss import RouterLoss
from .dispatch import ExpertParallelMixin, ExpertShard

__all__ = ["ExpertSums", "ExpertParallelMixin", "ExpertShard", "RouterLoss", "apply_expert_parallel",
           "expert_parameters"]
