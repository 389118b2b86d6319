"""Sequence parallelism wired into a Hugging Face decoder-only model, in place.

Between the tensor-parallel blocks each rank holds `c = ceil(s / tp)` rows of the
hidden states `(b, s, h)`: norms and residual adds run on 1/tp of the tokens.

    embed (full) -> layer 0 keeps its chunk -> [norm -> gather -> attention (column..row)
    -> reduce-scatter -> + residual -> norm -> gather -> MLP -> reduce-scatter -> + residual]
    x layers -> norm -> gather -> head

A block's all-gather has a reduce-scatter as its adjoint (its column layers' input gradients are
partial sums), so the column layers' own all-reduce is off; row layers reduce-scatter instead of
all-reducing (same bytes). Parameters that see only this rank's tokens (the norms) sum their gradients over tp.

Multi-head latent attention's `kv_a_proj_with_mqa` (style `mla_kv_a`, checked by `binding.latent_attention`)
stays a whole nn.Linear on every tp rank. Its output is the kv latent (into `kv_b_proj`, a column layer whose
f sums its gradient over tp) and, in its last `rope` features, the rotary key every head shares, which
reaches this rank's heads directly: those go through f (`RotaryKeyCopy`), so the projection's gradient is
the whole one on every rank. Under sequence parallelism the gather's reduce-scatter sums what reaches the
attention's input: the rotary key's gradient stays this rank's share, and the projection's weight gradient
is summed over tp as the block's other whole modules' are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..models.blocks import LATENT_ATTENTION
from ..models.hf_decoder import Backbone
from ..binding.tp_switches import sequence_blocks
from ..binding.latent_attention import is_latent_attention
from .comm import copy_to_parallel
from .layers import ColumnParallelLinear, RowParallelLinear
from .mixins import add_mixin
from .partial_grads import make_grad_allreduce
from .sequence import gather_from_sequence, scatter_to_sequence

__all__ = ["SequenceState", "apply_sequence_parallel", "sequence_state", "RotaryKeyCopy", "make_rotary_key_copy"]

_STATE = "_rewrite_sequence_state"


@dataclass
class SequenceState:
    """The full sequence length of the forward in flight, for the final gather to drop padding.

    Set by the base model's forward (from its input) or by the pipeline stage running a microbatch;
    one forward runs at a time on a rank.
    """

    group: ProcessGroup
    length: int | None = None


def sequence_state(model: nn.Module) -> SequenceState | None:
    """The state `apply_sequence_parallel` attached to `model`, or None."""
    return getattr(model, _STATE, None)


def _hidden_arg(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    """Split off the hidden states, passed first or as `hidden_states=` (HF call styles)."""
    if "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        return kwargs.pop("hidden_states"), args, kwargs
    return args[0], args[1:], kwargs


class _RecordLength:
    """The base model: the length of what it is called on is the sequence the final norm restores."""

    sequence: SequenceState

    def forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        source = ids if ids is not None else kwargs.get("inputs_embeds")
        if source is not None:
            self.sequence.length = source.shape[1]
        return super().forward(*args, **kwargs)


class _ScatterInput:
    """The first decoder layer: keep this rank's chunk of the full (replicated) hidden states."""

    sequence: SequenceState

    def forward(self, *args, **kwargs):
        hidden, args, kwargs = _hidden_arg(args, kwargs)
        return super().forward(scatter_to_sequence(hidden, self.sequence.group), *args, **kwargs)  # (b, c, h)


class _GatherInput:
    """An attention or MLP block: all-gather the sequence chunks before the column layers.

    Attention drops the padding rows (its rotary embeddings and mask are for s tokens); the MLP works
    row by row, padding included.
    """

    sequence: SequenceState

    def forward(self, *args, **kwargs):
        hidden, args, kwargs = _hidden_arg(args, kwargs)
        rotary = kwargs.get("position_embeddings")
        # s: the rotary embeddings' length; an attention without them (called with its mask, positions, ...):
        # that of the forward in flight; an MLP (the hidden states alone): None, padding kept
        length = rotary[0].shape[-2] if isinstance(rotary, tuple) else self.sequence.length if args or kwargs else None
        full = gather_from_sequence(hidden, self.sequence.group, length=length)  # (b, s or tp*c, h)
        return super().forward(full, *args, **kwargs)


class _GatherOutput:
    """The final norm: its output is gathered back to the whole sequence for the head."""

    sequence: SequenceState
    gather_grad: str  # "reduce_scatter" when a sharded head consumes it, else "split"

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)  # (b, c, h)
        return gather_from_sequence(out, self.sequence.group, length=self.sequence.length, grad=self.gather_grad)


class RotaryKeyCopy:
    """Mixin in front of an nn.Linear: its last `rope` output features read through f over `tp_group`."""

    tp_group: ProcessGroup
    rope: int
    sequence = False  # under sequence parallelism: no f here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.sequence:
            return out
        latent, rotary = out.split([out.shape[-1] - self.rope, self.rope], dim=-1)
        return torch.cat([latent, copy_to_parallel(rotary, self.tp_group)], dim=-1)


def make_rotary_key_copy(module: nn.Module, group: ProcessGroup, rope: int) -> nn.Module:
    """Sum the gradient of `module`'s last `rope` output features over `group`, in place."""
    add_mixin(module, RotaryKeyCopy)
    module.tp_group, module.rope = group, rope
    return module


def _input_is_reduced(x: torch.Tensor) -> torch.Tensor:
    # A column layer behind a sequence gather: the gather's backward already sums the
    # input gradient over tp, so the layer's own all-reduce (f) must not run again.
    return x


def _gathered(block: nn.Module, state: SequenceState) -> None:
    """A block of split linears: its input gathered to the whole sequence, its row layers scattering it again.

    Multi-head latent attention's latent projections and norms run whole before its column layers: with the
    columns' f off, their gradients are this rank's heads' share, summed over tp as a norm's are (and the
    rotary key's gradient is left partial too: the gather's reduce-scatter sums what reaches the input)."""
    add_mixin(block, _GatherInput).sequence = state
    for sub in block.modules():
        if isinstance(sub, ColumnParallelLinear):
            sub.input_copy = _input_is_reduced
        elif isinstance(sub, RowParallelLinear):
            sub.sequence_parallel = True
        elif isinstance(sub, RotaryKeyCopy):
            sub.sequence = True
        if is_latent_attention(sub):
            for name in LATENT_ATTENTION.whole:
                latent = getattr(sub, name, None)
                if latent is not None:
                    make_grad_allreduce(latent, state.group)


def _mixture(block: nn.Module, at: str, blocks, experts: str, split: Collection[str], state: SequenceState) -> None:
    """A mixture of experts' block on the rank's part: its split children gathered, its experts split over ep
    or tp (`split`) left alone, every other module's own parameters summing their gradients over tp."""
    inside = [f"{b}." for b in blocks if b.startswith(f"{at}.")] + ([f"{experts}."] if experts in split else [])
    for name, module in block.named_modules():
        path = f"{at}.{name}" if name else at
        if path in blocks:
            _gathered(module, state)
        elif not any(f"{path}.".startswith(p) for p in inside):
            make_grad_allreduce(module, state.group)  # a router, a gate, experts whole: this rank's tokens only


def apply_sequence_parallel(
    model: nn.Module, bb: Backbone, group: ProcessGroup, styles: Mapping[str, str], split_experts: Collection[str] = ()
) -> SequenceState:
    """Wire sequence parallelism into a model whose blocks are already tensor-parallel, in place.

    `styles` maps module paths to the plan's styles. Each decoder layer's blocks
    (`tp_switches.sequence_blocks`: the children holding split linears, checked when the plan was
    bound) gather the sequence first; its norms run on the rank's part and sum their gradients over
    tp, as do a mixture of experts' router and experts kept whole (`split_experts`: the experts
    modules split over ep or tp, left alone). Returns the shared `SequenceState`.
    """
    base = model.get_submodule(bb.base) if bb.base else model
    state = SequenceState(group)
    setattr(model, _STATE, state)
    add_mixin(base, _RecordLength).sequence = state
    layers = model.get_submodule(bb.layers)
    for i in range(bb.num_layers):
        layer = layers[i]
        if i == 0:
            add_mixin(layer, _ScatterInput).sequence = state
        blocks, _, moe = sequence_blocks(layer, bb.layer(i), styles)
        for name, child in layer.named_children():
            at = f"{bb.layer(i)}.{name}"
            if at in blocks:
                _gathered(child, state)
            elif at in moe:
                _mixture(child, at, blocks, moe[at], split_experts, state)
            else:  # the layer norms: each rank sees its tokens only
                for sub in child.modules():
                    make_grad_allreduce(sub, group)
    norm = model.get_submodule(bb.norm)
    for sub in norm.modules():
        make_grad_allreduce(sub, group)
    add_mixin(norm, _GatherOutput).sequence = state
    head = getattr(model, "lm_head", None) if bb.head else None
    sharded_head = isinstance(head, ColumnParallelLinear)
    norm.gather_grad = "reduce_scatter" if sharded_head else "split"
    if sharded_head:
        head.input_copy = _input_is_reduced
    return state
