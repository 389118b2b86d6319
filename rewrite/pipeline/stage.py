"""Stage: one rank's callable piece of a rewritten model: one pipeline stage, or several with
`pipeline.virtual_stages` (stage ids are global: 0 .. pp * virtual_stages - 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from ..mesh import Mesh
from ..binding.resolve import ResolvedPlan
from ..expert_parallel.aux_loss import RouterLoss
from ..grad_finish import GradFinish
from .timeline import StepClock, TimelineEvent
from .loss import LogitShard

__all__ = ["ForwardFn", "Precision", "Stage", "TimelineEvent", "precision_for"]

# Runs one stage on a microbatch: fn(x), or for an HF backbone fn(x, seq_len=..., position_ids=...).
ForwardFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Precision:
    """How a stage computes in `dtype` over parameters kept in `master` (docs/precision.md): where dp shards
    the parameters, FSDP2's mixed precision policy casts what it gathers; elsewhere the runner's autocast."""

    dtype: torch.dtype  # the compute dtype
    master: torch.dtype  # the parameters' (and gradients', optimizer state's) dtype
    by: Literal["fsdp", "autocast"]  # FSDP2's mixed precision policy casts, or the runner's autocast

    def forward_context(self, device: torch.device):
        """What a stage's forward runs under: autocast, or nothing (FSDP2 already cast the weights)."""
        if self.by == "autocast":
            return torch.autocast(device.type, dtype=self.dtype)
        return contextlib.nullcontext()


def precision_for(compute: torch.dtype | None, master: torch.dtype, *, shards: bool) -> Precision | None:
    """The recipe for computing in `compute` over `master` parameters; None when they are one dtype.

    `shards`: data parallelism shards the parameters (FSDP2 `full` or `grad_op`, dp > 1).

    Raises:
        ValueError: `compute` is not a floating dtype, or wider than `master` (a float32
            computation over bfloat16 weights would only pretend to be more precise).
    """
    if compute is None or compute == master:
        return None
    if not isinstance(compute, torch.dtype) or not compute.is_floating_point:
        raise ValueError(f"compute_dtype {compute!r}: use a floating torch dtype, e.g. torch.bfloat16")
    if torch.finfo(compute).bits > torch.finfo(master).bits:
        raise ValueError(
            f"compute_dtype {compute} is wider than the parameters' {master}: build the model in {compute} "
            f"(float32 master weights), or leave compute_dtype out"
        )
    return Precision(compute, master, "fsdp" if shards else "autocast")


@dataclass
class Stage:
    """This rank's stage(s) of a model rewritten by `apply_plan`.

    Attributes:
        model: the user's model, rewritten in place: on this rank only this rank's stages'
            modules, at their original paths.
        module: holds this rank's parameters (the model, or an fx GraphModule over its submodules).
        resolved: the plan bound to the model.
        mesh: this rank's coordinates and process groups.
        forward_fns: stage id -> what runs that stage on one microbatch.
        tied: parameters shared with another rank (tied embeddings), gradients summed over
            `mesh.tied_group`.
        clock: the last step's action times on this rank (`timeline` reads them), or None.
        grad_finish: what completes the step's gradients on this rank, only those it needs, in the
            runner's order (`rewrite.grad_finish` lists the kinds).
        recomputed: modules recomputed in the backward (`activation_checkpointing`); their
            weight gradients come with the I, W is empty.
        compiled: modules whose forward runs under torch.compile (`compile`; `rewrite.compiled`).
        logit_shard: the last stage's vocabulary slice of the logits (`loss_parallel`), else None.
        precision: computing in a lower dtype than the parameters' (`apply_plan(..., compute_dtype=)`:
            FSDP2's mixed precision or autocast); None computes in the parameters' dtype.
        router_loss: a mixture of experts' auxiliary loss, added to each microbatch's loss as the
            model's own forward would (`config.output_router_logits`); None when the model adds none.

    Not frozen: `carve_stage` builds it and `apply_plan` fills in the fields after `tied`; the runner
    replaces `clock` each step, and loading a checkpoint re-points `tied` at the tensors it gave
    storage to (the meta parameters carving saw are gone).

    Example:
        >>> stage = rewrite.apply_plan(model, "plans/llama-pp2.yaml")
        >>> stage.is_first, stage.is_last
        (True, False)
    """

    model: nn.Module
    module: nn.Module
    resolved: ResolvedPlan
    mesh: Mesh
    forward_fns: dict[int, ForwardFn]
    tied: list[nn.Parameter] = field(default_factory=list)
    clock: StepClock | None = None
    grad_finish: tuple[GradFinish, ...] = ()
    recomputed: tuple[str, ...] = ()
    compiled: tuple[str, ...] = ()
    logit_shard: LogitShard | None = None
    precision: Precision | None = None
    router_loss: RouterLoss | None = None

    def __call__(self, x, *, seq_len: int | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run this rank's only stage on one microbatch (see `run`)."""
        if len(self.forward_fns) != 1:
            raise TypeError(f"this rank holds stages {list(self.stage_ids)}: run one with stage.run(stage_id, x)")
        return self.run(self.stage_ids[0], x, seq_len=seq_len, position_ids=position_ids)

    def run(self, stage_id: int, x, *, seq_len: int | None = None, position_ids: torch.Tensor | None = None,
            sequence_shard=None) -> torch.Tensor:
        """Run stage `stage_id` (one this rank holds) on one microbatch.

        Args:
            x: the model input on the first stage (token ids `[mb, seq]`, or a dict of `input_ids`
                and `position_ids`), hidden states on the others.
            seq_len: the whole sequence length, needed past the first stage under `sequence_parallel`.
            position_ids: `[mb, seq]`, needed by every stage of a packed microbatch.
            sequence_shard: under context parallelism, which tokens this rank holds
                (`context_parallel.SequenceShard`); `x` and `position_ids` are then those tokens'.
        """
        if stage_id not in self.forward_fns:
            raise ValueError(f"stage {stage_id} is not on this rank; it holds stages {list(self.stage_ids)}")
        if isinstance(x, dict):
            position_ids = x.get("position_ids", position_ids)
            x = x["input_ids"]
        kwargs = {k: v for k, v in (("seq_len", seq_len), ("position_ids", position_ids),
                                    ("sequence_shard", sequence_shard)) if v is not None}
        if "position_ids" in kwargs and not self.takes_token_ids:
            raise TypeError("position_ids need a Hugging Face decoder model run by the module walker; "
                            "a traced stage takes its inputs as its forward does")
        out = self.forward_fns[stage_id](x, **kwargs)
        # A whole Hugging Face model run as one traced stage returns its ModelOutput: the runner takes its logits.
        return out if isinstance(out, torch.Tensor) or not hasattr(out, "logits") else out.logits

    @property
    def timeline(self) -> list[TimelineEvent]:
        """The last step's events on this rank (on a GPU, reading them waits for the step's work)."""
        return [] if self.clock is None else self.clock.events()

    def finishing(self, kind: type) -> GradFinish | None:
        """This rank's gradient finisher of class `kind` (e.g. `data_parallel.GradSync`), or None."""
        return next((f for f in self.grad_finish if isinstance(f, kind)), None)

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The stages this rank holds, in model order (one unless pipeline.virtual_stages > 1)."""
        return tuple(sorted(self.forward_fns))

    @property
    def pp_rank(self) -> int:
        """This rank's place in the pipeline (mesh.pp_rank); its stages are `stage_ids`."""
        return self.mesh.pp_rank

    @property
    def dp(self) -> int:
        """Data-parallel replicas (mesh.dp)."""
        return self.mesh.dp

    @property
    def dp_rank(self) -> int:
        """Which replica this rank belongs to: it passes that replica's microbatches."""
        return self.mesh.dp_rank

    @property
    def num_stages(self) -> int:
        """Stages of the whole pipeline: pp * pipeline.virtual_stages."""
        return self.resolved.num_stages

    @property
    def stage_rank(self) -> tuple[int, ...]:
        """The pp rank holding each stage."""
        return self.resolved.stage_rank

    @property
    def is_first(self) -> bool:
        """This rank runs the model's first stage (it reads the model input)."""
        return 0 in self.forward_fns

    @property
    def is_last(self) -> bool:
        """This rank runs the model's last stage (it computes the loss)."""
        return self.num_stages - 1 in self.forward_fns

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    @property
    def device(self) -> torch.device:
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the activations this stage exchanges: the compute dtype where FSDP2 casts
        the weights (`precision`), else its floating parameters' dtype (autocast keeps the
        residual stream in it; the runner casts a stage output to it before sending)."""
        if self.precision is not None and self.precision.by == "fsdp":
            return self.precision.dtype
        return next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.get_default_dtype())

    @property
    def takes_token_ids(self) -> bool:
        """True for LLaMA-family stages: the model's input is `[mb, seq]` token ids."""
        return self.resolved.backbone is not None

    @property
    def vocab_size(self) -> int | None:
        """Token ids the model's embedding accepts, `[0, vocab_size)`; None for traced models."""
        return self.model.config.vocab_size if self.takes_token_ids else None

    @property
    def num_classes(self) -> int | None:
        """Size of the output's last dimension when known before running (the LM head's vocabulary)."""
        bb = self.resolved.backbone
        return self.model.config.vocab_size if bb is not None and bb.has_head else None

    def boundary_shapes(self, input_shape: tuple[int, ...], stage_id: int | None = None) -> dict[str, tuple[int, ...] | None]:
        """`{"input": ..., "output": ...}`: a microbatch's shapes entering and leaving stage `stage_id`
        (default this rank's only one), from the model input's `input_shape` (e.g. `(mb, seq)`); None
        where only running the stage tells (traced models announce shapes on the wire instead)."""
        s = self.stage_ids[0] if stage_id is None else stage_id
        first, last = s == 0, s == self.num_stages - 1
        bb = self.resolved.backbone
        if bb is None:
            return {"input": tuple(input_shape) if first else None, "output": None}
        config, plan, tp = self.model.config, self.resolved.plan, self.mesh.tp
        seq = input_shape[-1] // self.mesh.cp  # a context-parallel rank holds seq / cp tokens
        hidden = (*input_shape[:-1], seq, config.hidden_size)  # (mb, seq, hidden)
        if plan.sequence_parallel and tp > 1:  # each tp rank passes on its ceil(seq / tp) tokens
            hidden = (*input_shape[:-1], -(-seq // tp), config.hidden_size)
        vocab = config.vocab_size // tp if self.logit_shard is not None else config.vocab_size
        out = (*input_shape[:-1], seq, vocab) if bb.has_head else hidden
        return {"input": tuple(input_shape) if first else hidden, "output": out if last else hidden}

    def __repr__(self) -> str:
        mods = list(self.resolved.rank_modules(self.pp_rank))
        held = f"stages {list(self.stage_ids)}" if len(self.stage_ids) > 1 else f"{self.stage_ids[0]}"
        return (f"Stage({held}/{self.num_stages}, tp_rank={self.mesh.tp_rank}/{self.mesh.tp}, "
                f"rank={self.mesh.rank}, modules={mods})")
