"""The parity check: one rewritten step against the same step in a single process."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_parallel.layers import local_shard
from ..pipeline.runner import causal_lm_loss
from ..tensor_parallel.loss import IGNORE_INDEX
from ..agreement import share
from ..lent import lend

__all__ = ["Parity", "reference_step", "parity_check"]


@dataclass(frozen=True)
class Parity:
    """Step 1 against the single-process step, maxima over every rank."""

    max_dloss: float  # |loss - reference loss|
    max_dgrad: float  # max |grad - reference grad| over every element (sharded: the matching slice)
    num_params: int  # distinct parameters of the model compared, over all ranks
    total_params: int  # parameters the model trains (num_params should equal it)

    def line(self) -> str:
        """The one line rank 0 prints."""
        missing = "" if self.num_params == self.total_params else f" (of {self.total_params}: some never compared)"
        return (
            f"parity vs single process (step 1): max |dloss| = {self.max_dloss:.1e}, "
            f"max |dgrad| = {self.max_dgrad:.1e} over {self.num_params} parameters{missing}"
        )


def reference_step(reference: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """The same step single-process: each microbatch's summed cross-entropy over the trained tokens
    (targets other than -100) of all of them, gradients accumulated. A microbatch
    with positions (a dict of input_ids and position_ids) runs the model's own forward with them and
    no cache: it masks packed documents off each other itself. A mixture of experts that reports its
    routers' auxiliary loss (`aux_loss`, under `output_router_logits`) adds it with its own coefficient,
    as its forward does with labels, over the number of microbatches."""
    total = torch.zeros(())
    tokens = sum(int((y != IGNORE_INDEX).sum()) for y in targets)
    for x, y in zip(inputs, targets):
        out = reference(**x, use_cache=False) if isinstance(x, dict) else reference(input_ids=x)
        loss = causal_lm_loss(out.logits, y, reduction="sum") / tokens
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + reference.router_aux_loss_coef * out.aux_loss / len(inputs)
        loss.backward()
        total += loss.detach()
    return total


def parity_check(
    model: nn.Module, reference: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor], loss: torch.Tensor
) -> Parity:
    """Compare this rank's gradients and the step loss with `reference` run on one process.

    Collective: every rank calls it after a step (`run_schedule`) and before the optimizer step.
    `reference` is a copy of the model taken before `apply_plan`; it is stepped here, on
    `inputs` and `targets`: the global batch (every replica's microbatches) under data parallelism.
    """
    ref_loss = reference_step(reference, inputs, targets)
    ref = dict(reference.named_parameters(remove_duplicate=False))
    dgrad, compared = 0.0, []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name not in ref:  # would be a rewriter bug: report it as a failed comparison
            dgrad = float("inf")
            continue
        got = param.grad if param.grad is not None else torch.zeros_like(param)
        if hasattr(got, "full_tensor"):  # a data-parallel shard: gathered over the replicas (collective)
            got = got.full_tensor()
        want = ref[name].grad if ref[name].grad is not None else torch.zeros_like(ref[name])
        dgrad = max(dgrad, (got - local_shard(model, name, want)).abs().max().item())
        compared.append(name)
    stats = torch.tensor([abs(float(loss) - float(ref_loss)), dgrad], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    lend(stats)
    every = share(compared)
    ids = {id(ref[n]) for names in every for n in names}  # tied weights count once
    total = len({id(p) for p in reference.parameters() if p.requires_grad})  # what is trained (a LoRA run: adapters)
    return Parity(float(stats[0]), float(stats[1]), len(ids), total)
