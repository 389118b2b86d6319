"""torch.compile on a plan's repeated blocks: each decoder layer, the embedding and the head on their own.

Per block, as torchtitan compiles: one graph per block, the same for every layer (the layers share their
code, so the first compile serves them all), small enough to compile in seconds and to fail alone. The
block's `forward` is replaced in place: its parameters keep their names (checkpoints are the same whether
written compiled or eager) and the hooks on the module (FSDP2's gathers and reduce-scatters, the
tensor-parallel layers' bookkeeping) run outside the graph, as they do eagerly. A recomputed block is
compiled with its checkpoint inside the graph (torch traces torch.utils.checkpoint), so recomputation stays
what the plan says.

Collectives inside a block (tensor parallelism's sums, gathers and reduce-scatters, context parallelism's
K/V all-gather) are traced as torch's functional collectives (`tensor_parallel.comm.traced`): no graph
break. Each block compiles with `fullgraph=True`, so a break is an error at its first call; then (a model's
own code dynamo cannot trace) the block runs eagerly from there on, after one warning naming the model and
the reason, with the same results. One split is made on purpose: a block holding experts split over ep
compiles in two graphs around their token exchange, whose sizes depend on the routing.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch import nn

from .binding.resolve import ResolvedPlan
from .errors import first_line
from .plan.schema import Compile
from .torch_internals import (allow_side_effects_in_recomputed_graphs, inductor_default_cache_dir, keep_compile_caches,
                              untraceable_errors)

__all__ = ["apply_compile", "CompiledForward", "compile_cache_dir", "use_compile_cache"]


_WARNED: set[str] = set()  # the reasons a block fell back to eager, each warned once


class CompiledForward:
    """A block's forward under torch.compile, falling back to the eager one (for good, with one warning) when
    dynamo cannot trace it whole."""

    def __init__(self, forward, options: Compile, *, where: str, fullgraph: bool = True):
        self.eager, self.where, self.fullgraph = forward, where, fullgraph
        extra = {"mode": options.mode} if options.backend == "inductor" else {}
        self.compiled = torch.compile(forward, backend=options.backend, dynamic=options.dynamic, fullgraph=fullgraph,
                                      **extra)
        self.broke: str | None = None  # why this block runs eagerly, once it does
        self.__wrapped__ = forward

    def __call__(self, *args, **kwargs):
        if self.broke is not None:
            return self.eager(*args, **kwargs)
        if _holds_cache(args, kwargs):
            # A KV cache (transformers' forward makes one unless told `use_cache=False`): each layer reads its own
            # slot of it, so every layer would compile a graph of its own, past torch's recompile limit. Steps
            # pass none; a call with one (generation, a plain `model(ids)`) runs eagerly.
            if _CACHED not in _WARNED:
                _WARNED.add(_CACHED)
                warnings.warn(f"compile: {self.where} and the other compiled blocks run eagerly when given a KV cache "
                              "(pass use_cache=False to run them compiled; training steps pass none)", stacklevel=2)
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except untraceable_errors() as exc:
            # A graph break, or shapes that depend on the data: raised while tracing, before anything ran.
            self.broke = first_line(exc)
            if self.broke not in _WARNED:  # once per reason: the layers of a model break alike
                _WARNED.add(self.broke)
                warnings.warn(f"compile: {self.where} (and any block that breaks alike) runs eagerly: torch.compile "
                              f"cannot trace it whole ({self.broke})", stacklevel=2)
            return self.eager(*args, **kwargs)


_CACHED = "a KV cache"


def _holds_cache(args: tuple, kwargs: dict) -> bool:
    """Whether a transformers KV cache is among a block's arguments."""
    from transformers.cache_utils import Cache

    return any(isinstance(value, Cache) for value in (*args, *kwargs.values()))


def block_paths(resolved: ResolvedPlan) -> list[str]:
    """The modules the plan compiles, in model order: a decoder's embedding, layers and head; an fx-traced
    model's stage modules (its pipeline units)."""
    backbone = resolved.backbone
    if backbone is None:
        return list(dict.fromkeys(m for stage in resolved.stages for m in stage.modules))
    head = [backbone.head] if backbone.head else []
    return [backbone.embed, *(backbone.layer(i) for i in range(backbone.num_layers)), *head]


def apply_compile(model: nn.Module, resolved: ResolvedPlan) -> tuple[str, ...]:
    """Compile each block of `model` this rank holds (`plan.compile`); returns their paths (none without it).
    Call after the parallel layers and recomputation are in place and before data parallelism wraps them."""
    options = resolved.plan.compile
    if options is None:
        return ()
    # The column layers sharing one input copy remember it while their block runs (`SharedInputCopy`): a
    # Python side effect inside a recomputed block, which the trace need not repeat in the backward (the
    # sharing is in the graph already). torch refuses such a block unless told so.
    allow_side_effects_in_recomputed_graphs()
    family = type(model).__name__
    done = []
    for path in block_paths(resolved):
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue  # carved away: another pipeline rank holds it
        # A block holding experts split over ep is split on purpose at their exchange (`expert_parallel.dispatch`).
        split = any(getattr(m, "expert_shard", None) is not None for m in module.modules())
        module.forward = CompiledForward(module.forward, options, where=f"{family}'s {path}", fullgraph=not split)
        done.append(path)
    return tuple(done)


def compile_cache_dir() -> Path:
    """Where compiled blocks are kept between runs: $TORCHINDUCTOR_CACHE_DIR when the user set it, else
    $XDG_CACHE_HOME/rewrite/compile (~/.cache/rewrite/compile), not inductor's default under /tmp (gone at a
    reboot)."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(inductor_default_cache_dir()):
        return Path(chosen)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rewrite" / "compile"


def use_compile_cache(directory: str | Path | None = None) -> Path:
    """Keep inductor's FX graph and AOT autograd caches in `directory` (default `compile_cache_dir()`), so the
    next run of the same plan reads its kernels instead of compiling them. Before the first compile."""
    path = Path(directory) if directory is not None else compile_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    keep_compile_caches()
    return path
