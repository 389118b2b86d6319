"""Parallel plans: the Pydantic schema. Reading files is `loading.py`; binding to a model, `rewrite.binding`."""

from __future__ import annotations

from typing import Annotated, Literal

import yaml
from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_serializer, model_validator

from .files import PlanError
from .ranks import Shape, length_problem
from .styles import Style
from .pipeline_schema import Count, Pattern, Pipeline, StrictModel, cut_point_problems, schedule_problems
from ..schedules import splits_backward

__all__ = ["ParallelPlan", "MeshSpec", "DataParallel", "Pipeline", "PlanError", "Checkpointing", "CHECKPOINT_KINDS", "Lora", "Compile"]


class MeshSpec(StrictModel):
    """How the ranks are arranged: dp * pp * cp * tp of them, numbered as `torch.arange(world).view(dp, pp, cp, tp)`:
    a stage's tp ranks are neighbours (one machine), dp replicas outermost (across machines)."""

    # The plan's `mesh` section (`ranks.Shape` places the ranks); `rewrite.Mesh` is a running
    # mesh with its process groups. Titled "Mesh" in the JSON schema, as the plan names it.
    model_config = ConfigDict(extra="forbid", frozen=True, title="Mesh")

    dp: Annotated[Count, Field(description=(
        "Data-parallel replicas (>= 1): each runs the whole pipeline on its own slice of the "
        "global batch; see data_parallel for how parameters are shared out."))] = 1
    pp: Annotated[Count, Field(description="Pipeline ranks (>= 1), each holding pipeline.virtual_stages stages.")] = 1
    tp: Annotated[Count, Field(description="Tensor-parallel ranks per stage (>= 1); contiguous global ranks.")] = 1
    cp: Annotated[Count, Field(description=(
        "Context-parallel ranks per stage (>= 1): each holds seq / cp tokens of every microbatch (two "
        "chunks of 2 cp, balanced for the causal mask) and attention gathers the keys and values of the "
        "others; parameters are replicated over them like dp replicas."))] = 1
    ep: Annotated[Count, Field(description=(
        "Expert-parallel ranks (>= 1, dividing dp x tp): adds no ranks. Each group of ep consecutive ranks "
        "of a stage's dp x tp (tp fastest) splits the experts of every mixture-of-experts layer (the "
        "modules a tensor_parallel rule names 'expert_parallel'), E / ep per rank; each tp rank sends its "
        "share of the tokens to their experts' ranks and back by all-to-all."))] = 1

    @model_serializer(mode="wrap")
    def _without_cp_one(self, handler):
        # cp 1 and ep 1 are every plan before them: written plans and digests leave them out.
        data = handler(self)
        for key in ("cp", "ep"):
            if isinstance(data, dict) and data.get(key) == 1:
                data.pop(key)
        return data

    @model_validator(mode="after")
    def _ep_divides_dp_tp(self) -> MeshSpec:
        stage = self.dp * self.tp
        if self.ep > 1 and stage % self.ep:
            fits = [e for e in range(2, stage + 1) if stage % e == 0]
            use = f"use ep {', '.join(map(str, fits))} or 1" if fits else "use ep 1, or dp x tp a multiple of ep"
            raise ValueError(f"mesh.ep={self.ep} does not divide mesh.dp x mesh.tp = {self.dp} x {self.tp} = {stage}: "
                             "expert parallelism borrows its ranks from a stage's data-parallel replicas and "
                             f"tensor-parallel ranks (each group of ep of them splits the experts); {use}")
        return self

    @property
    def world_size(self) -> int:
        return self.shape.world

    @property
    def shape(self) -> Shape:
        """The sizes as a `ranks.Shape`: global ranks and coordinates (`shape.rank`, `shape.coords`), groups."""
        return Shape(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep)

    def shape_text(self) -> str:
        """`pp=2 x tp=2`, with dp and cp when above 1 and ` (ep=2)` after it with ep (`Shape.text`)."""
        return self.shape.text()


CheckpointMode = Literal["full", "selective"]


class Checkpointing(StrictModel):
    """A checkpointing mode for some of the modules a pattern matches."""

    mode: Annotated[CheckpointMode, Field(description="'full' or 'selective', as the short form.")] = "full"
    every: Annotated[Count, Field(description=(
        "Checkpoint the first of every `every` matched modules, in the model's order (1: all of them)."))] = 1


# A mode alone, or a mapping of one: the two kinds told apart first, so a bad value gets its kind's one message.
CHECKPOINT_KINDS = ("mode", "mapping")
CheckpointValue = Annotated[
    Annotated[CheckpointMode, Tag("mode")] | Annotated[Checkpointing, Tag("mapping")],
    Discriminator(lambda v: "mapping" if isinstance(v, dict | Checkpointing) else "mode"),
]


class DataParallel(StrictModel):
    """How data-parallel replicas hold parameters, gradients and optimizer state (mesh.dp > 1)."""

    sharding: Annotated[Literal["full", "grad_op", "replicate"], Field(description=(
        "'full' (default): torch FSDP2 `fully_shard` per decoder layer: parameters, gradients and "
        "optimizer state divided by dp, parameters gathered for each use (ZeRO-3); 'grad_op': the "
        "same, parameters kept gathered from forward to backward (ZeRO-2-like); 'replicate': whole "
        "parameters on every replica, gradients averaged once per step. Ignored when mesh.dp = 1."))] = "full"
    reduce: Annotated[Literal["step", "microbatch"], Field(description=(
        "When gradients are reduced over dp. 'step' (default): once per step, after the step's "
        "backwards, each rank holding its stage's whole gradients until then (least traffic); "
        "'microbatch': as each unit's backward ends, every microbatch (torch FSDP2's default: "
        "under 'full' and 'grad_op' only one unit's whole gradients at a time, microbatches times "
        "the traffic). Schedules that split backwards (W after I) need 'step'. Ignored when mesh.dp = 1."))] = "step"


class Lora(StrictModel):
    """Low-rank adaptation (LoRA, Hu et al. 2021) as PEFT computes it: each target linear layer's output gains
    `alpha / rank * B(A(dropout(x)))`, A `[rank, in]` and B `[out, rank]` trained, every other weight frozen."""

    rank: Annotated[Count, Field(description="The adapters' rank r (>= 1): A is [r, in_features], B [out_features, r].")]
    alpha: Annotated[float | None, Field(gt=0, description=(
        "The scale's numerator: adapters add alpha / rank times their product (PEFT's lora_alpha). "
        "Default: the rank (a scale of 1)."))] = None
    dropout: Annotated[float, Field(ge=0, lt=1, description=(
        "Dropout on the adapters' input while training (PEFT's lora_dropout), 0 <= p < 1. Under tensor "
        "parallelism a rank draws the mask of the whole input and uses its slice, so the ranks of a stage, "
        "seeded alike, drop what one process would."))] = 0.0
    seed: Annotated[int, Field(ge=0, strict=True, description=(
        "Fresh adapters' A is drawn from this seed and the layer's path (B starts at zero): the same on every "
        "rank and under every plan, whatever each process's random state."))] = 0
    targets: Annotated[list[Pattern] | None, Field(description=(
        "Module-path patterns of the linear layers that get adapters (`*` within one path segment). Default: "
        "every decoder layer's attention and MLP projections (q/k/v/o, gate/up/down, fused gate_up, latent "
        "attention's q_b/kv_b; shared experts' too). Routed experts are refused: adapters there are not built."
        ), min_length=1)] = None

    @property
    def scaling(self) -> float:
        """alpha / rank: what the adapters' product is multiplied by."""
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


class Compile(StrictModel):
    """Each decoder layer, the embedding and the head compiled on their own (torchtitan's per-block compile):
    one graph per block, collectives inside it traced as torch's functional collectives, hooks (FSDP2's
    gathers) left outside. `compile: true` takes every default."""

    backend: Annotated[Literal["inductor", "aot_eager", "eager"], Field(description=(
        "torch.compile's backend: 'inductor' generates fused kernels (the one that is faster); 'aot_eager' "
        "traces forward and backward but runs torch's own kernels, 'eager' traces the forward only: both "
        "to tell a compiler problem from a model problem."))] = "inductor"
    mode: Annotated[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"], Field(
        description="inductor's mode (torch.compile's `mode`): 'reduce-overhead' adds CUDA graphs on a GPU."
        )] = "default"
    dynamic: Annotated[bool | None, Field(strict=True, description=(
        "Shapes in the graphs: None (default) compiles a block for the shapes of its first call and, when a "
        "later call differs (another sequence length), once more with those sizes symbolic, so a block "
        "compiles at most twice whatever the data; false one static graph per distinct shape (up to torch's "
        "recompile limit, then eager); true symbolic from the start."))] = None


class ParallelPlan(StrictModel):
    """A parallel plan: the mesh, which linears to shard, and the pipeline.

    Example:
        >>> plan = ParallelPlan.model_validate({"mesh": {"tp": 2},
        ...     "tensor_parallel": {"model.layers.*.mlp.up_proj": "colwise"}})
        >>> plan.tensor_parallel["model.layers.*.mlp.up_proj"]
        'column'
    """

    model_config = ConfigDict(extra="forbid", frozen=True, title="rewrite parallel plan")

    description: Annotated[str | None, Field(description="Free text: what the plan is for.")] = None
    mesh: Annotated[MeshSpec, Field(description="World size = dp * pp * cp * tp.")] = MeshSpec()
    tensor_parallel: Annotated[dict[Pattern, Style], Field(description=(
        "Module-path pattern -> style. `*` matches within one path segment. "
        "With mesh.tp = 1 the rules are still checked against the model but change nothing."))] = {}
    pipeline: Annotated[Pipeline, Field(description="Microbatches, schedule, virtual stages and stage cut points.")] = Pipeline()
    data_parallel: Annotated[
        DataParallel, Field(description="How the mesh.dp replicas share parameters (torch DDP-style or FSDP2).")
    ] = DataParallel()
    activation_checkpointing: Annotated[dict[Pattern, CheckpointValue], Field(description=(
        "Module-path pattern -> mode. 'full': the matched modules keep only their inputs from the "
        "forward and run it again in the backward (torch's non-reentrant torch.utils.checkpoint), "
        "trading compute for activation memory; e.g. {'model.layers.*': full}. 'selective': op-level, "
        "as torchtitan's default policy: the attention kernels' outputs and every other matrix product's "
        "(the first, third, ... of each call) are kept as well, the rest run again (torch's selective "
        "checkpoint contexts). {mode: full, every: k}: the first of every k modules the pattern matches, "
        "in the model's order (every: 2, every other layer). Works with tp, pp, dp and every schedule."))] = {}
    loss_parallel: Annotated[bool, Field(description=(
        "With the LM head sharded as 'column': the runner's cross-entropy works on vocabulary "
        "shards (max, sum of exponentials and target logit reduced over tp), never building full "
        "[tokens, vocab] logits. model(...) and generate still return full logits."))] = False
    sequence_parallel: Annotated[bool, Field(description=(
        "Between the tensor-parallel attention and MLP blocks, split the hidden states along the "
        "sequence over tp: norms and residual adds run on 1/tp of the tokens, each block "
        "all-gathers its input and reduce-scatters its output (HF LLaMA-family models)."))] = False
    lora: Annotated[Lora | None, Field(description=(
        "Train low-rank adapters on the target linear layers, every other weight frozen (PEFT's LoRA). Under "
        "tensor parallelism each adapter is split as its layer is (see docs/lora.md). None: train every weight."
        ))] = None
    compile: Annotated[Compile | None, Field(description=(
        "torch.compile every decoder layer, the embedding and the head, each on its own, under any mesh "
        "(see docs/compile.md): true, or its options. None or false: run eagerly."))] = None
    _source: str = PrivateAttr(default="plan")  # file the plan was read from, for messages
    _lines: dict = PrivateAttr(default_factory=dict)  # (key, key, ...) -> line in that file

    @property
    def source(self) -> str:
        """Where the plan came from: its file path, or 'plan'."""
        return self._source

    def where(self, *loc: str | int) -> str:
        """'line 7: ' for the key at `loc` (e.g. 'tensor_parallel', pattern) in the plan file; '' for a dict."""
        line = self._lines.get(loc)
        return f"line {line}: " if line else ""

    @model_validator(mode="before")
    @classmethod
    def _compile_switch(cls, data):
        # `compile: true` is every default, `compile: false` no compile.
        if isinstance(data, dict) and isinstance(data.get("compile"), bool):
            data = {**data, "compile": {} if data["compile"] else None}
        elif isinstance(data, dict) and not isinstance(data.get("compile"), (dict, Compile, type(None))):
            raise ValueError(f"compile: use true, false or the options {{backend, mode, dynamic}}; found "
                             f"{data['compile']!r}")
        return data

    @model_validator(mode="after")
    def _pipeline_fits_mesh(self) -> ParallelPlan:
        # Cut points for pp x virtual_stages stages; the schedule's rules; a custom table run on paper.
        pipe, pp = self.pipeline, self.mesh.pp
        problems = cut_point_problems(pipe.cut_points, pp, pipe.virtual_stages)
        problems += schedule_problems(pipe.schedule, pipe.table, pp, pipe.virtual_stages, pipe.microbatches)
        if self.mesh.cp > 1 and pipe.seq_len is not None and (problem := length_problem(pipe.seq_len, self.mesh.cp)):
            problems.append(f"{self.where('pipeline', 'seq_len')}pipeline.seq_len: {problem}")
        if self.mesh.dp * self.mesh.cp > 1 and self.data_parallel.reduce == "microbatch" and splits_backward(pipe.schedule, pipe.table):
            problems.append("data_parallel.reduce: microbatch reduces each unit's gradients as its backward ends, but "
                            f"{'the custom table' if pipe.schedule == 'custom' else f'schedule {pipe.schedule}'} "
                            "splits backwards (W computes the weight gradients after I); use reduce: step (the "
                            "default) with it")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def to_yaml(self) -> str:
        """The plan as YAML text that `load_plan` reads back to an equal plan."""
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)
