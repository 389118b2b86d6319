"""`train_step_pipeline_afab(model, inputs, targets, device, dtype)`, the established contract."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rewrite
from rewrite.run.presets import build_model
from tests.asserts import assert_close
from rewrite.run.parity import reference_step
from tests.multiproc import run
from tests.reference import assert_grads_match

WATCHED = ("embed_tokens", "rotary_emb", "layers.0", "layers.1", "layers.2", "layers.3", "norm")


def _watch(model: nn.Module, record: dict) -> None:
    """Test-only hooks: every forward output and backward grad-output, per module, in call order."""

    def names():
        for name, module in model.named_modules():
            short = name.removeprefix("model.")
            if short in WATCHED or name == "lm_head":
                yield short, module

    for short, module in names():
        def forward_hook(mod, args, out, short=short):
            record.setdefault(("forward", short), []).append(
                tuple(o.detach().clone() for o in out) if isinstance(out, tuple) else out.detach().clone()
            )

        def backward_hook(mod, grad_in, grad_out, short=short):
            if grad_out[0] is not None:
                record.setdefault(("backward", short), []).append(grad_out[0].detach().clone())

        module.register_forward_hook(forward_hook)
        if short != "rotary_emb":
            module.register_full_backward_hook(backward_hook)


def _contract(rank: int, ws: int, steps: int) -> list[str]:
    model = build_model("tiny-llama", seed=11)
    reference = copy.deepcopy(model)
    seen, expected = {}, {}
    _watch(model, seen)
    _watch(reference, expected)
    gen = torch.Generator().manual_seed(12)
    for step in range(steps):
        inputs = [torch.randint(0, 256, (2, 8), generator=gen) for _ in range(4)]
        targets = [torch.randint(0, 256, (2, 8), generator=gen) for _ in range(4)]
        loss = rewrite.train_step_pipeline_afab(model, inputs, targets, torch.device("cpu"), torch.float32)
        ref_loss = reference_step(reference, inputs, targets)
        assert_close(f"step {step} loss on rank {rank}", loss, ref_loss)
    assert_grads_match(model, reference, prefix=f"rank {rank} ")  # accumulated over the steps
    for (phase, name), outputs in seen.items():
        ref = expected[(phase, name)]
        assert len(outputs) == len(ref), f"{phase} {name}: {len(outputs)} calls, reference {len(ref)}"
        for mb, (got, want) in enumerate(zip(outputs, ref)):
            pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
            for k, (g, w) in enumerate(pairs):
                assert_close(f"rank {rank} {phase} {name} call {mb}[{k}]", g, w, atol=1e-5)
    return sorted({name for _, name in seen})


@pytest.mark.parametrize("world_size", [1, 2])
def test_train_step_pipeline_afab(world_size):
    called = run(_contract, world_size, 2, timeout_s=180)
    if world_size == 2:
        assert called[0] == sorted(["embed_tokens", "rotary_emb", "layers.0", "layers.1"])
        assert called[1] == sorted(["rotary_emb", "layers.2", "layers.3", "norm", "lm_head"])
    else:
        assert called[0] == sorted([*WATCHED, "lm_head"])


def _model_and_batch(seed: int, shape: tuple[int, int], microbatches: int):
    """A tiny LLaMA, its untouched copy, and next-token microbatches."""
    model = build_model("tiny-llama", seed=seed)
    gens = [torch.Generator().manual_seed(i) for i in range(microbatches)]
    inputs = [torch.randint(0, 256, shape, generator=g) for g in gens]
    return model, copy.deepcopy(model), inputs, [torch.roll(x, -1, dims=1) for x in inputs]


def _four_ranks(rank: int, ws: int) -> float:
    model, reference, inputs, targets = _model_and_batch(4, (1, 6), 3)
    loss = rewrite.train_step_pipeline_afab(model, inputs, targets, "cpu", torch.float32)
    assert_close("loss", loss, reference_step(reference, inputs, targets))
    assert_grads_match(model, reference, prefix=f"rank {rank} ")
    layers = sorted(
        int(n.split(".")[2]) for n, _ in model.named_parameters() if n.endswith("input_layernorm.weight")
    )
    assert layers == [rank], layers  # one layer per rank with 4 layers on 4 ranks
    return float(loss)


def test_train_step_pipeline_afab_four_ranks():
    losses = run(_four_ranks, 4, timeout_s=120)
    assert len(set(losses)) == 1, "the step loss is the same on every rank"


def _bf16(rank: int, ws: int) -> float:
    model, reference, inputs, targets = _model_and_batch(6, (2, 8), 2)
    loss = rewrite.train_step_pipeline_afab(model, inputs, targets, "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    ref_loss = reference_step(reference, inputs, targets)
    assert abs(float(loss) - float(ref_loss)) < 0.05 * float(ref_loss), (float(loss), float(ref_loss))
    return float(loss)


def test_train_step_pipeline_afab_bf16():
    losses = run(_bf16, 2, timeout_s=120)
    assert losses[0] == losses[1]
