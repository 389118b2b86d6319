"""One step's state on a rank while the runner executes its row: the stage inputs and outputs held between
an action and the next (F to B, I to W), the losses, the transfers in flight, and what each action does.

Zero-bubble schedules split a stage's backward: I computes the gradient of the stage input only,
which the previous stage is waiting for; W the parameters' gradients, which nobody waits for, so a
schedule can put it in what would otherwise be a bubble. torch.distributed.pipelining already splits
the autograd graph this way (it keeps the gradients at the nodes where the weight paths leave the
input path, and W resumes from them): `StepState.backward` and `run` call its two functions
(private to torch: `torch_internals`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..context_parallel.attention import sequence_part
from ..doing import doing
from ..schedules import Action
from ..torch_internals import backward_input as _input_half, backward_weight as _weight_half
from . import p2p
from .timeline import StepClock
from .loss import LossFn
from .p2p import Inbox, messages_between
from .batches import ids_of, positions_of
from .router_sums import RouterSums
from .stage import Stage

__all__ = ["StepState", "on_device"]


_EVENT = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


class StepState:
    """One step's state on this rank: stage inputs and outputs held between F and B (or I and W), losses, sends."""

    def __init__(self, stage: Stage, table, inputs, targets, loss_fn: LossFn, tokens: int | None):
        self.m, self.mesh, self.device, self.dtype = len(inputs), stage.mesh, stage.device, stage.dtype
        self.stage, self.loss_fn = stage, loss_fn
        # What a microbatch's loss is divided by for its share of the step's: the global batch's trained
        # tokens (token-weighted), or the microbatches of every replica (a user loss's per-microbatch mean).
        self.divisor = tokens if tokens is not None else self.m * self.mesh.dp
        # The replicas' gradients are averaged over dp x cp (FSDP2, DDP): each backward is scaled by
        # that count, so the averaged gradients are those of the step's loss.
        self.replicas = self.mesh.dp * self.mesh.cp
        self.precision, mesh = stage.precision, stage.mesh
        self.inputs = on_device(inputs, self.device) if stage.is_first else inputs
        # Every stage of a packed microbatch needs its positions: read from this rank's copy.
        self.positions = on_device([positions_of(x) for x in self.inputs], self.device)
        self.parts = None  # under context parallelism: this rank's tokens of each microbatch
        if mesh.cp > 1:
            self.parts = [sequence_part(ids_of(x), positions_of(x), targets[i] if stage.is_last else None,
                                        group=mesh.cp_group, cp=mesh.cp, rank=mesh.cp_rank, device=self.device)
                          for i, x in enumerate(inputs)]
        self.targets = on_device(targets, self.device) if stage.is_last else targets
        self.place, self.last, me = stage.stage_rank, stage.num_stages - 1, stage.pp_rank
        # I is input-only and W the rest, unless this rank recomputes activations or compiles its blocks: a split
        # backward would recompute once per weight group, and a compiled block's backward is one node that W
        # would run again; so I runs it whole and W is empty.
        whole = stage.recomputed or stage.compiled
        self.split = set() if whole else {(a.mb, a.stage) for a in table[me] if a.kind == "I"}
        self.held: dict[tuple[int, int], tuple] = {}  # (mb, stage) -> (stage input, output or loss)
        # (mb, stage) -> what W needs: the backward's saved split (groups), or (outputs, their gradients) whole
        self.deferred: dict[tuple[int, int], tuple[list, tuple | None]] = {}
        self.local: dict[tuple, torch.Tensor] = {}  # handed between two stages of this rank
        self.losses: dict[int, torch.Tensor] = {}
        self.sends: list[tuple[list, torch.Tensor]] = []  # in-flight works, with the tensor they read
        self.clock = stage.clock = StepClock(self.device)
        self.routers = None if stage.router_loss is None else RouterSums(stage.router_loss, self.m, mesh.cp, self.device)
        self.inboxes = {}
        for peer in range(mesh.pp):
            if order := messages_between(table[peer], self.place, peer, me, sums=self.routers is not None):
                self.inboxes[peer] = Inbox(mesh.rank_at(pp=peer), order, self._shape_of, self.device)

    def _params(self) -> list:
        # Asked at each B and W: a data-parallel unit swaps in its gathered parameters, the
        # ones the autograd graph holds, while it is gathered.
        return [p for p in self.stage.parameters() if p.requires_grad]

    def _shapes(self, mb: int, s: int) -> dict:
        return self.stage.boundary_shapes(tuple(ids_of(self.inputs[mb]).shape), s)

    def _shape_of(self, key):
        kind, mb, s = key
        if kind in ("f", "b"):
            return self.routers.shape
        if kind == "B" and (mb, s) in self.held:  # the forward ran: its output says
            y = self.held[mb, s][1]
            return tuple(y.shape), y.dtype
        shape = self._shapes(mb, s)["input" if kind == "F" else "output"]
        return None if shape is None else (shape, self.dtype)

    def run(self, action: Action) -> None:
        start = self.clock.mark()
        kind, mb, s = action.kind, action.mb, action.stage
        if kind == "F":
            start = self.forward(mb, s)
        elif kind in ("B", "I"):
            start = self.backward(mb, s)
        elif (mb, s) in self.split:
            groups, whole = self.deferred.pop((mb, s))
            if whole is not None:
                torch.autograd.backward(*whole)
            elif groups:
                _weight_half(iter(self._params()), groups)
            del self.held[mb, s]
        name = "backward" if kind == "I" and (mb, s) not in self.split else _EVENT[kind]
        self.clock.add(self.mesh.rank, s, mb, name, start, self.clock.mark())

    def _take(self, kind: str, mb: int, s: int) -> torch.Tensor:
        """The activation entering stage `s` ("F") or the gradient of its output ("B"); "f", "b": the router
        sums beside them."""
        peer = self.place[s - 1] if kind in ("F", "f") else self.place[s + 1]
        if peer == self.stage.pp_rank:
            return self.local.pop((kind, mb, s))
        return self.inboxes[peer].take((kind, mb, s))

    def _hand_on(self, kind: str, mb: int, s: int, tensor: torch.Tensor) -> None:
        """Give stage `s` its input ("F") or its output's gradient ("B"), here or on its rank."""
        peer = self.place[s]
        if peer == self.stage.pp_rank:
            self.local[kind, mb, s] = tensor
            return
        dst = self.mesh.rank_at(pp=peer)
        if kind == "F" and self._shapes(mb, s)["input"] is None:
            self._send(*p2p.send_header(tensor, dst), dst)
        self._send(p2p.send(tensor, dst), tensor, dst)

    def forward(self, mb: int, s: int):
        part = None if self.parts is None else self.parts[mb]
        if s == 0:
            x = ids_of(self.inputs[mb]).to(self.device) if part is None else part.ids
            if x.is_floating_point():
                x = x.to(self.dtype)
        else:
            x = self._take("F", mb, s)
            x.requires_grad_(x.is_floating_point())
        start = self.clock.mark()
        routers = self.routers
        if routers is not None:
            routers.start()
        with nullcontext() if self.precision is None else self.precision.forward_context(self.device):
            if part is not None:  # this rank's tokens: the stage's sequence is seq / cp long
                y = self.stage.run(s, x, seq_len=part.ids.shape[-1], position_ids=part.positions,
                                   sequence_shard=part.shard)
            elif self.stage.takes_token_ids:  # stages past a sequence-parallel split need the whole length
                y = self.stage.run(s, x, seq_len=ids_of(self.inputs[mb]).shape[-1], position_ids=self.positions[mb])
            else:
                y = self.stage.run(s, x)
            sums = None if routers is None else routers.forward(
                mb, s, None if s == 0 else self._take("f", mb, s), last=s == self.last)
            if s == self.last:
                # This rank's share of the step's loss: its tokens' (its part of the sequence, under cp)
                # over the divisor, plus its share of the routers' loss (a mean over every replica's microbatches).
                share = self.loss_fn(y, (self.targets[mb] if part is None else part.targets).to(y.device)) / self.divisor
                if sums is not None:
                    share = share + routers.last_share(sums.to(share.device)) / (self.m * self.mesh.dp)
                self.losses[mb] = share
                y = share * self.replicas if self.replicas > 1 else share
        if s != self.last:
            if y.is_floating_point() and y.dtype != self.dtype:
                y = y.to(self.dtype)  # under autocast: stages exchange what their peers' buffers hold
            self._hand_on("F", mb, s + 1, y.detach())
            if sums is not None:
                self._hand_on("f", mb, s + 1, sums)
        self.held[mb, s] = (x, y)
        return start

    def backward(self, mb: int, s: int):
        x, y = self.held[mb, s]
        grad = None if s == self.last else self._take("B", mb, s)
        roots, grads, sums = [y], None if grad is None else [grad], None
        if self.routers is not None:  # a middle stage's routers: the loss's gradient through them joins
            sums, extra = self.routers.backward(mb, s, None if s == self.last else self._take("b", mb, s))
            if extra is not None:
                roots, grads = [y, extra], [grad, torch.ones_like(extra)]
        start = self.clock.mark()
        if (mb, s) in self.split:
            if x.is_floating_point() and x.requires_grad:
                (dx,), groups = _input_half(roots, grads, [x], iter(self._params()))
                self.deferred[mb, s] = (groups, None)
            else:  # x takes no gradient (token ids on the first stage): W runs the whole backward
                dx, self.deferred[mb, s] = None, ([], (roots, grads))
        else:
            torch.autograd.backward(roots, grads)
            dx = x.grad if x.is_floating_point() else None
            del self.held[mb, s]  # free this microbatch's activations
        if s == self.last:
            self.losses[mb] = self.losses[mb].detach()  # its graph would keep the received input alive
        if s > 0:
            self._hand_on("B", mb, s - 1, dx if dx is not None else torch.zeros_like(x))
            if sums is not None:
                self._hand_on("b", mb, s - 1, sums)
        return start

    def _send(self, works: list, tensor: torch.Tensor, dst: int) -> None:
        # Keep what is still in flight; let tensors whose sends completed go, so memory
        # follows the schedule (1F1B: pp - s microbatches), not the step's length.
        self.sends = [(w, t, d) for w, t, d in self.sends if not all(x.is_completed() for x in w)]
        self.sends.append((works, tensor, dst))

    def finish(self) -> None:
        for works, _, dst in self.sends:
            with doing(f"the step's last sends, to rank {dst}", peer=dst):
                p2p.wait(works)
        self.sends = []


def on_device(values, device: torch.device):
    """The step's tensors on the stage's device, copied ahead from pinned host memory.

    A copy from ordinary host memory waits for the device to finish its queue first; a
    pinned one is queued like a kernel, so the step's copies cost no host synchronisation.
    """
    if device.type == "cpu" or values is None:
        return values

    def copy(x):
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if not isinstance(x, torch.Tensor):
            return x
        return x.to(device) if x.device.type != "cpu" else x.pin_memory().to(device, non_blocking=True)

    return [copy(x) for x in values]
