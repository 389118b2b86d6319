"""The private torch calls rewrite makes exist on the torch it runs on, as `torch_internals` says.

A torch release that moves one fails here, naming it, before any training step reaches it.
"""

from __future__ import annotations

import re
import tomllib

import torch
from torch.distributed.pipelining import _backward

from rewrite import torch_internals
from tests.paths import ROOT


def test_the_torch_range_stated_is_the_release_checked():
    spec = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                if d.startswith("torch"))
    low = re.search(r">=([\d.]+)", spec)[1]
    assert low == torch_internals.CHECKED_ON, (spec, torch_internals.CHECKED_ON)
    assert torch.__version__.startswith(torch_internals.CHECKED_ON + "."), (
        f"torch {torch.__version__} is outside the checked release {torch_internals.CHECKED_ON}"
    )


def test_transformers_is_the_release_the_families_were_checked_on():
    import transformers

    spec = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                if d.startswith("transformers"))
    low, high = re.search(r">=([\d.]+),<([\d.]+)", spec).groups()
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split("."))), (spec, transformers.__version__)


def test_every_private_name_used_is_there():
    assert callable(_backward.stage_backward_input) and callable(_backward.stage_backward_weight)
    assert hasattr(torch_internals.replicate, "state") and hasattr(torch.distributed.fsdp.fully_shard, "state")
    assert callable(torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert hasattr(FSDPState, "_root_post_backward_final_callback")
    assert hasattr(torch._C._distributed_c10d.Reducer, "_check_reducer_finalized")
    assert hasattr(torch._C._distributed_c10d.Reducer, "prepare_for_backward")
    from torch.distributed import _functional_collectives as funcol

    assert all(callable(f) for f in (funcol.all_reduce, funcol.all_gather_tensor, funcol.reduce_scatter_tensor))
    assert all(issubclass(e, Exception) for e in torch_internals.untraceable_errors())
    assert hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint")
    assert isinstance(torch_internals.inductor_default_cache_dir(), str)
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    assert hasattr(inductor_config, "fx_graph_cache") and hasattr(functorch_config, "enable_autograd_cache")


def test_a_buffer_registered_not_to_persist_is_told_apart():
    module = torch.nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert torch_internals.buffer_persists(module, "kept") and not torch_internals.buffer_persists(module, "scratch")
    assert set(module.state_dict()) == {"kept"}
