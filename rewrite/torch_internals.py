"""Every private torch call rewrite makes, in one place, with the torch release it was checked on.

Each is wrapped in a function named for what it does, so a torch release that moves one breaks here (at
import or in `tests/unit/test_torch_internals.py`), not inside a training step. `replicate` is FSDP2's,
for replicas where DDP does not fit (several stages per rank, split backwards).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import _backward
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "CHECKED_ON", "replicate", "finish_fsdp_backward", "prepare_ddp_for_backward", "ddp_reducer_finished",
    "backward_input", "backward_weight", "ddp_ignore", "default_store", "buffer_persists", "traced_all_reduce",
    "traced_all_gather", "traced_reduce_scatter", "untraceable_errors", "allow_side_effects_in_recomputed_graphs",
    "keep_compile_caches", "inductor_default_cache_dir",
]

CHECKED_ON = "2.13"


def finish_fsdp_backward(root: nn.Module, *, replicated: bool) -> None:
    """End the step's backward on an FSDP2 (or `replicate`) root: reduce, then reshard, as FSDP2's own hook would
    (each parameter group's post-backward, then the root's final callback). Run once per step, after the last
    of a pipeline's backwards: FSDP2 assumes one backward per step."""
    state = replicate.state(root) if replicated else fully_shard.state(root)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def ddp_ignore(module: nn.Module, names: list[str]) -> None:
    """Have the DDP built next on `module` leave its parameters `names` alone, neither broadcast nor reduced
    (experts split over ep); set before building it."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def prepare_ddp_for_backward(ddp: DistributedDataParallel) -> None:
    """Arm DDP's reducer for the next backward, the step's last (what DDP's forward does when it syncs)."""
    ddp.reducer.prepare_for_backward([])


def ddp_reducer_finished(ddp: DistributedDataParallel) -> bool:
    """Whether the last backward reduced every bucket of DDP's reducer."""
    try:
        ddp.reducer._check_reducer_finalized()
    except RuntimeError:
        return False
    return True


def backward_input(
    outputs: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
    params: Iterator[nn.Parameter],
) -> tuple[tuple, list]:
    """dL/d`inputs` now (`grads` None: `outputs` are losses); returns them and the groups `backward_weight` needs.
    torch.distributed.pipelining's split backward, which zero-bubble schedules need."""
    return _backward.stage_backward_input(outputs, grads, inputs, params)


def backward_weight(params: Iterator[nn.Parameter], groups: list) -> None:
    """dL/dW of `params`, from the groups `backward_input` kept."""
    _backward.stage_backward_weight(params, groups)


def default_store():
    """The default process group's store (`torch.distributed.Store`), where ranks whose wait timed out leave what
    they were doing for each other (`run/stall_report.py`); raises RuntimeError without one."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def buffer_persists(module: nn.Module, name: str) -> bool:
    """Whether `module`'s own buffer `name` goes into its state dict (not registered with `persistent=False`)."""
    return name not in module._non_persistent_buffers_set


# torch.compile: functional collectives (dynamo and inductor put them in the graph), the errors that mean a
# block cannot be traced whole, dynamo's and inductor's switches, inductor's default cache directory.

def traced_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over `group`, as a functional collective (a new tensor, traceable)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


def traced_all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order, as a functional collective."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_gather_tensor(x, dim, group)


def traced_reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's block along `dim` of the sum of `x` over `group`, as a functional collective."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.reduce_scatter_tensor(x, "sum", dim, group)


def untraceable_errors() -> tuple[type[Exception], ...]:
    """What dynamo raises while tracing a `fullgraph` function it cannot capture whole (a graph break; shapes that
    depend on the data; a graph past its recompile limit), before any of that call runs."""
    from torch._dynamo import exc

    # FailOnRecompileLimitHit: a block that needed more graphs than torch keeps for one function, under fullgraph.
    return exc.Unsupported, exc.UserError, exc.FailOnRecompileLimitHit


def allow_side_effects_in_recomputed_graphs() -> None:
    """Let dynamo trace a checkpointed region with Python side effects, which the recomputation in the backward
    does not repeat (torch refuses such a region unless told)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def keep_compile_caches() -> None:
    """Have inductor keep its FX graph cache and AOT autograd's cache on disk (their defaults, made sure of)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True


def inductor_default_cache_dir() -> str:
    """The directory inductor caches in when TORCHINDUCTOR_CACHE_DIR is not set (it then sets the variable to it
    itself, so its presence does not say the user chose it)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()
