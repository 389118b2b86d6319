"""The pipeline runner: one rank's row of a schedule table, executed.

A schedule is data (`rewrite.plan.schedules`): per rank, its forwards and backwards in
order. The runner checks the whole table on paper, then runs this rank's row: it
receives what each action needs from the neighbouring stage, computes, sends the
result on, scales the loss, accumulates gradients and records a timeline. It knows
nothing of LLaMA or plans.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..plan.schedules import Action, build_table, plan_table, table_problems
from . import p2p
from .inputs import check_step_inputs
from .stage import Stage, TimelineEvent

__all__ = ["run_afab", "run_schedule", "causal_lm_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the vocabulary, targets already aligned, -100 ignored.

    Computed in float32 whatever the logits' dtype.
    """
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100)


def run_afab(
    stage: Stage,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] | None,
    loss_fn: LossFn | None = None,
) -> torch.Tensor:
    """One training step, all-forward-all-backward; gradients accumulate in `.grad`.

    Args:
        stage: this rank's `Stage` from `apply_plan`.
        inputs: one tensor per microbatch. Pass the same list on every rank: the first
            stage feeds it to the model, later stages read only its length and shapes.
        targets: one tensor per microbatch, aligned with the model output; needed on
            the last stage (may be None elsewhere).
        loss_fn: `loss_fn(output, target)`; default: cross-entropy over the last
            dimension with ignore_index=-100. Each microbatch's loss is divided by
            the number of microbatches, so the gradients are those of the batch mean.

    Returns:
        The step loss (float32 scalar), the same on every rank.

    Raises:
        ValueError: the same on every rank, before any transfer, if any rank's arguments are
            bad (token ids outside the vocabulary, targets the default loss cannot take, ...)
            or ranks were given different microbatches (count, shapes, dtypes).

    Example:
        >>> loss = run_afab(stage, input_chunks, target_chunks)
        >>> optimizer.step(); optimizer.zero_grad()
    """
    check_step_inputs(stage, inputs, targets, default_loss=loss_fn is None)
    return _run(stage, build_table("afab", stage.num_stages, len(inputs)), inputs, targets, loss_fn)


def run_schedule(
    stage: Stage,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] | None,
    loss_fn: LossFn | None = None,
) -> torch.Tensor:
    """One training step under the plan's `pipeline.schedule`; same arguments and result as `run_afab`.

    Named schedules run any number of microbatches; a custom table runs exactly the
    plan's `pipeline.microbatches`.

    Example:
        >>> stage = apply_plan(model, {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b"}})
        >>> loss = run_schedule(stage, input_chunks, target_chunks)
    """
    check_step_inputs(stage, inputs, targets, default_loss=loss_fn is None, what="run_schedule")
    pipeline, pp, m = stage.resolved.plan.pipeline, stage.num_stages, len(inputs)
    if pipeline.schedule == "custom" and m != pipeline.microbatches:
        # The same on every rank: the microbatch count was agreed on above.
        raise ValueError(
            f"run_schedule: the plan's custom table runs {pipeline.microbatches} microbatches, "
            f"got {m}; split the batch into {pipeline.microbatches}"
        )
    return _run(stage, plan_table(pipeline.schedule, pipeline.table, pp, m), inputs, targets, loss_fn)


def _run(stage: Stage, table, inputs, targets, loss_fn: LossFn | None) -> torch.Tensor:
    problems = table_problems(table, stage.num_stages, len(inputs))
    if problems:  # every rank holds the same table, so every rank refuses it alike
        raise ValueError("the schedule cannot run: " + "; ".join(problems))
    step = _Step(stage, inputs, targets, loss_fn or causal_lm_loss, table[stage.stage_idx])
    stash = _stash_tied_grads(stage)
    for action in table[stage.stage_idx]:
        if action.kind == "F":
            step.forward(action.mb)
        else:
            step.backward(action.mb)
    step.finish()
    _sum_tied_grads(stage, stash)
    return _broadcast_loss(stage, [step.losses[i] for i in sorted(step.losses)], stage.device)


class _Inbox:
    """Receives from one neighbour, in the order this rank's row consumes them, posted one ahead.

    Posting early overlaps the transfer with compute. Activations whose shape only the
    sender knows (traced models) come after a header, itself posted early and waited on
    only when needed; gradients take the shape of the forward output, so they are posted
    once that forward has run.
    """

    def __init__(self, src: int | None, order: list[int], shape_of: Callable, device: torch.device, *, headers: bool):
        self.src, self.order, self.shape_of, self.device, self.headers = src, order, shape_of, device, headers
        self.posted: dict[int, tuple] = {}
        self.next = 0
        self._post(0)

    def _post(self, index: int) -> None:
        if self.src is None or index >= len(self.order) or index in self.posted:
            return
        known = self.shape_of(self.order[index])
        if known is not None:
            self.posted[index] = ("data", *p2p.recv(self.src, known[0], known[1], self.device))
        elif self.headers:
            self.posted[index] = ("header", *p2p.recv(self.src, p2p.HEADER_SHAPE, torch.int64, self.device))

    def take(self, mb: int) -> torch.Tensor:
        """Wait for microbatch `mb`'s tensor (the next one in row order) and post the one after."""
        index = self.next
        if self.order[index] != mb:
            raise RuntimeError(f"expected microbatch {self.order[index]} next from rank {self.src}, not {mb}")
        self._post(index)
        kind, buffer, works = self.posted.pop(index)
        for work in works:
            work.wait()
        if kind == "header":
            shape, dtype = p2p.decode_header(buffer)
            buffer, works = p2p.recv(self.src, shape, dtype, self.device)
            for work in works:
                work.wait()
        self.next += 1
        self._post(self.next)
        return buffer


class _Step:
    """One step's state on this rank: stage inputs and outputs held between F and B, losses, sends."""

    def __init__(self, stage: Stage, inputs, targets, loss_fn: LossFn, row: tuple[Action, ...]):
        self.stage, self.inputs, self.targets, self.loss_fn = stage, inputs, targets, loss_fn
        self.m, self.mesh, self.device, self.dtype = len(inputs), stage.mesh, stage.device, stage.dtype
        self.shapes = [stage.boundary_shapes(tuple(x.shape)) for x in inputs]
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # mb -> (stage input, output)
        self.losses: dict[int, torch.Tensor] = {}
        self.sends: list[tuple[list, torch.Tensor]] = []  # in-flight works, with the tensor they read
        stage.timeline = []
        fwd = [a.mb for a in row if a.kind == "F"]
        bwd = [a.mb for a in row if a.kind == "B"]
        prev, nxt = self.mesh.prev_rank, self.mesh.next_rank
        self.activations = _Inbox(prev, fwd, self._input_shape, self.device, headers=True)
        self.gradients = _Inbox(nxt, bwd, self._output_shape, self.device, headers=False)

    def _input_shape(self, mb: int):
        shape = self.shapes[mb]["input"]
        return None if shape is None else (shape, self.dtype)

    def _output_shape(self, mb: int):
        if mb in self.held:  # the forward ran: its output says
            y = self.held[mb][1]
            return tuple(y.shape), y.dtype
        return None  # posted once the forward has run

    def _record(self, mb: int, kind: str, start: float) -> None:
        event = TimelineEvent(self.mesh.rank, self.stage.stage_idx, mb, kind, start, time.time())
        self.stage.timeline.append(event)

    def forward(self, mb: int) -> None:
        if self.stage.is_first:
            x = self.inputs[mb].to(self.device)
            if x.is_floating_point():
                x = x.to(self.dtype)
        else:
            x = self.activations.take(mb)
            x.requires_grad_(x.is_floating_point())
        start = time.time()
        y = self.stage(x)
        if self.stage.is_last:
            self.losses[mb] = self.loss_fn(y, self.targets[mb].to(y.device)) / self.m
            y = None
        else:
            out = y.detach()
            if self.shapes[mb]["output"] is None:
                self._send(*p2p.send_header(out, self.mesh.next_rank))
            self._send(p2p.send(out, self.mesh.next_rank), out)
        self.held[mb] = (x, y)
        self._record(mb, "forward", start)

    def backward(self, mb: int) -> None:
        x, y = self.held[mb]
        if self.stage.is_last:
            start = time.time()
            self.losses[mb].backward()
            self.losses[mb] = self.losses[mb].detach()  # its graph would keep the received input alive
        else:
            grad = self.gradients.take(mb)
            start = time.time()
            torch.autograd.backward(y, grad)
        if not self.stage.is_first and x.is_floating_point():
            grad_x = x.grad if x.grad is not None else torch.zeros_like(x)  # (mb, seq, hidden)
            self._send(p2p.send(grad_x, self.mesh.prev_rank), grad_x)
        del self.held[mb]  # free this microbatch's activations
        self._record(mb, "backward", start)

    def _send(self, works: list, tensor: torch.Tensor) -> None:
        # Keep what is still in flight; let tensors whose sends completed go, so memory
        # follows the schedule (1F1B: pp - s microbatches), not the step's length.
        self.sends = [(w, t) for w, t in self.sends if not all(x.is_completed() for x in w)]
        self.sends.append((works, tensor))

    def finish(self) -> None:
        for works, _ in self.sends:
            for work in works:
                work.wait()
        self.sends = []


def _stash_tied_grads(stage: Stage) -> list:
    """Set aside gradients accumulated before this step, so only this step's are summed."""
    stash = [p.grad for p in stage.tied]
    for p in stage.tied:
        p.grad = None
    return stash


def _sum_tied_grads(stage: Stage, stash: list) -> None:
    for param, before in zip(stage.tied, stash):
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=stage.mesh.tied_group)
        param.grad = grad if before is None else before.add_(grad)


def _broadcast_loss(stage: Stage, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.stack([l.detach() for l in losses]).sum() if losses else torch.zeros((), device=device)
    total = total.to(device=device, dtype=torch.float32)
    dist.broadcast(total, src=stage.mesh.global_rank(stage.num_stages - 1, 0))
    return total
