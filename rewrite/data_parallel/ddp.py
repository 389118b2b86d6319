"""`sharding: replicate` on torch's own DistributedDataParallel, where it fits the stage.

DDP buckets the gradients (the first bucket small, the rest 25 MiB, in backward order) and starts each
bucket's all-reduce as soon as its last gradient is accumulated, beside the rest of the backward; FSDP2's
`replicate` reduces unit by unit, and on a CPU backend each reduction waits for itself. DDP fits a rank
running one stage with whole backwards: the step's last backward then reaches every parameter it trains.
Split backwards and virtual stages keep FSDP2's `replicate` (`apply.GradSync`).

The step drives DDP as `torch.distributed.pipelining` does: every backward but the last accumulates
locally (`require_backward_grad_sync` off, as in `no_sync`), and the reducer is prepared right before the
last. The stage never runs through DDP's `forward`; DDP is built at the first step, once the parameters
have storage (a model loaded from a checkpoint is rewritten on meta).
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from ..grad_finish import GradFinish
from ..torch_internals import ddp_ignore, ddp_reducer_finished, prepare_ddp_for_backward

__all__ = ["DdpSync", "reduce_doing"]


def reduce_doing(over: str) -> str:
    """What a rank waiting in a data-parallel `finish` is doing (`GradFinish.doing`)."""
    return f"the data-parallel gradient reduce over {over}"


class DdpSync(GradFinish):
    """The stage's data-parallel `GradFinish` for `replicate` on DDP: one bucketed, overlapped all-reduce per step."""

    def __init__(self, module: nn.Module, group: ProcessGroup, *, ignore: list[str] = (), over: str = "dp"):
        self.module, self.group, self.ignore = module, group, list(ignore)  # ignore: parameter names DDP leaves alone
        self.doing = reduce_doing(over)
        self.ddp: DistributedDataParallel | None = None
        self.armed = False

    def begin(self) -> None:
        """Every backward of the step accumulates local gradients; DDP is built on the first call.

        Collective over the dp group on the first call (DDP checks the replicas' parameter
        shapes and starts them from dp rank 0's values); every rank calls it at its first step.
        """
        if self.ddp is None:
            if self.ignore:
                ddp_ignore(self.module, self.ignore)
            self.ddp = DistributedDataParallel(self.module, process_group=self.group, forward_sync_buffers=False)
        self.ddp.require_backward_grad_sync = False
        self.armed = False

    def next_backward_reduces(self) -> None:
        """The next backward is the step's last: DDP all-reduces each bucket as it fills."""
        self.ddp.require_backward_grad_sync = True
        prepare_ddp_for_backward(self.ddp)
        self.armed = True

    def finish(self) -> None:
        """Check that the last backward reduced every bucket (DDP averaged them over dp)."""
        if not self.armed:
            raise RuntimeError("replicate on DDP: the step had no whole last backward to reduce in")
        self.armed = False
        if not ddp_reducer_finished(self.ddp):
            missing = [n for n, p in self.module.named_parameters()
                       if p.requires_grad and p.grad is None and n not in self.ignore]
            raise RuntimeError(
                "data_parallel.sharding replicate: the step's last backward did not reach every trainable "
                f"parameter ({', '.join(missing[:4]) or 'some of them'}), so their gradients were not averaged "
                "over the replicas; freeze parameters the model does not use (requires_grad_(False))"
            )
