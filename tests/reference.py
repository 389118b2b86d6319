"""Single-process reference checks for rewritten models.

The expected slice of a sharded parameter is cut here with `chunk` over the layout the layers
document (tensor_parallel/layers.py, vocab.py), not with the library's own `shard_of`: a wrong
`shard_of` must fail these checks, not set their expectations."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from rewrite import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tests.asserts import assert_close


def _place(group) -> tuple[int, int]:
    """(rank, size) of this process in `group`, straight from torch.distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def expected_shard(model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the unsharded `full` that parameter `name` of a rewritten `model` should hold.

    Column: the output rows, each of `parts` packed blocks cut into tp / replicas slices, a rank
    holding slice rank // replicas of every block, blocks in order (a LoRA B alike, A whole). Row: the
    weight's input columns cut into tp slices (a LoRA A alike; the bias and B whole). Vocab: the embedding rows cut into tp slices.
    Fused experts split over ep: every tensor's experts (dim 0; each block of them) cut into ep slices, the rank
    of the expert-parallel group holding its slice. A bare per-head parameter split with its module's heads
    (attention sinks): its rows cut into tp slices, as the module's column layers' group. Anything else is whole.
    """
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if leaf in getattr(owner, "_rewrite_split_parameters", ()):
        column = next(m for m in owner.children() if isinstance(m, ColumnParallelLinear))
        rank, size = _place(column.group)
        return full.chunk(size)[rank]
    if isinstance(owner, ColumnParallelLinear):
        if leaf == "lora_A":  # a LoRA adapter's A [r, in]: whole beside the split output features
            return full
        rank, size = _place(owner.group)
        slices = size // owner.replicas
        return torch.cat([block.chunk(slices)[rank // owner.replicas] for block in full.chunk(owner.parts)])
    if isinstance(owner, RowParallelLinear):
        rank, size = _place(owner.group)
        return full if leaf in ("bias", "lora_B") else full.chunk(size, dim=1)[rank]
    if isinstance(owner, VocabParallelEmbedding):
        rank, size = _place(owner.group)
        return full.chunk(size)[rank]
    if hasattr(owner, "tp_group") and hasattr(owner, "num_experts"):  # each expert split over tp
        rank, size = _place(owner.tp_group)
        held = getattr(owner, leaf).shape
        dims = [d for d in range(full.dim()) if held[d] != full.shape[d]]
        if not dims:
            return full
        parts = 2 if "gate_up" in leaf else 1  # gate and up packed side by side
        return torch.cat([b.chunk(size, dim=dims[0])[rank] for b in full.chunk(parts, dim=dims[0])], dim=dims[0])
    if hasattr(owner, "expert_shard"):  # with identity experts: in blocks of gcd(routed, identity) experts
        rank, size = _place(owner.expert_shard.group)
        spec = owner.expert_shard.spec
        blocks = full.shape[0] // math.gcd(spec.num_experts, spec.identity)
        return torch.cat([block.chunk(size)[rank] for block in full.chunk(blocks)])
    return full


def assert_grads_match(model: nn.Module, reference: nn.Module, *, atol: float = 1e-5, prefix: str = "") -> int:
    """Every parameter's gradient equals the reference's (its slice, when sharded), within `atol` times
    the larger of 1 and the reference gradient's largest element: float32 reduction-order noise grows
    with a tensor's scale (a gated delta rule's conv1d gradients reach 9, and differ by 2e-5 under tp).
    A data-parallel DTensor gradient is gathered first: collective over its mesh, so every rank calls it."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    checked = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        assert name in ref, f"{prefix}{name}: no parameter of that name in the reference model"
        if param.grad is None and ref[name].grad is None:
            continue  # a parameter the forward does not use (a family's unused branch): untouched on both
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        scale = max(1.0, float(ref[name].grad.abs().max())) if ref[name].grad is not None else 1.0
        assert_close(f"{prefix}{name}.grad", grad, expected_shard(model, name, ref[name].grad), atol=atol * scale)
        checked += 1
    return checked


def assert_params_match(model: nn.Module, reference: nn.Module, *, atol: float = 0.0, prefix: str = "") -> None:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        assert_close(f"{prefix}{name}", param.detach(), expected_shard(model, name, ref[name].detach()), atol=atol)


def assert_replica_step(stage, model: nn.Module, reference: nn.Module, inputs: list, targets: list, tag: str):
    """Run this replica's equal share of the global batch `inputs` (replica d takes the d-th share, in
    order) and check the step loss and every gradient against `reference` running all of it in one
    process. Returns the loss. Collective: every rank calls it."""
    from rewrite import run_schedule
    from rewrite.run.parity import reference_step

    per = len(inputs) // stage.dp
    mine = slice(stage.dp_rank * per, (stage.dp_rank + 1) * per)
    loss = run_schedule(stage, inputs[mine], targets[mine])
    assert_close(f"{tag} loss", loss, reference_step(reference, inputs, targets))
    assert_grads_match(model, reference, prefix=f"{tag} ")
    return loss


def assert_shares_of(tag: str, model: nn.Module, reference: nn.Module) -> None:
    """Every parameter and stored buffer of the rewritten `model` is exactly its share of `reference`'s
    (a data-parallel DTensor gathered first: collective over its mesh, so every rank calls it)."""
    want = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    stored = model.state_dict().keys()
    for name, tensor in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in stored)]:
        whole = tensor.data.full_tensor() if hasattr(tensor.data, "full_tensor") else tensor.data
        assert torch.equal(whole, expected_shard(model, name, want[name])), f"{tag}: {name}"


def assert_counted_once(tag: str, stage, reference: nn.Module) -> None:
    """Every parameter of `stage` carries its split, and the elements whose copy counts, summed over every rank,
    are exactly the unsharded `reference`'s parameter count: each element counted once. Collective."""
    from rewrite.binding.shard_layout import split_of

    held = [p.to_local() if hasattr(p, "to_local") else p for p in stage.module.parameters() if split_of(p).counts]
    counted = torch.tensor([sum(p.numel() for p in held)], dtype=torch.int64)
    dist.all_reduce(counted)
    want = sum(p.numel() for p in reference.parameters())
    assert int(counted) == want, f"{tag}: {int(counted)} elements counted over the ranks, the model has {want}"


def assert_step_and_norm(model: nn.Module, plan, seq_len: int, tag: str):
    """Apply `plan` to `model` and check one step of 2 one-row microbatches per replica of `seq_len` random
    tokens (seed 5) against a copy of `model` in one process: the loss, every gradient and the gradient
    norm (`clip_grad_norm_`). Returns (the stage, the reference, the loss). Collective: every rank calls it."""
    import copy

    import rewrite

    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    ids = torch.randint(0, model.config.vocab_size, (2 * stage.dp, seq_len), generator=torch.Generator().manual_seed(5))
    inputs, targets = rewrite.microbatches(ids, 2 * stage.dp)
    loss = assert_replica_step(stage, model, reference, inputs, targets, tag)
    total = rewrite.clip_grad_norm_(stage, None)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None]))
    assert_close(f"{tag} gradient norm", total, norm)
    assert_counted_once(tag, stage, reference)
    return stage, reference, loss
