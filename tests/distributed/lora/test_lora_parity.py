"""LoRA under every kind of parallelism against PEFT in one process.

A tiny LLaMA gets random adapters on every projection; a copy wrapped by `peft.get_peft_model` with the same
adapters is the oracle. One step of each plan: the loss and every adapter gradient (each rank's slice) within
1e-5, the gradient norm, no gradient on any frozen weight, and frozen weights bit-identical after an AdamW step.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import rewrite
from rewrite.binding.lora_targets import is_adapter
from rewrite.run.parity import reference_step
from tests.asserts import assert_close
from tests.lora_oracle import Renamed, peft_twin, twin_names
from tests.multiproc import run
from tests.reference import assert_grads_match

VOCAB = 128
LORA = {"rank": 4, "alpha": 8.0}


def tiny(kv: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=kv, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def _plan(model, *, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, sharding: str = "full", sp: bool = False,
          vocab: bool = False, checkpointing: bool = False, dropout: float = 0.0, schedule: str = "1f1b") -> dict:
    data = rewrite.plan_from_hf(model, tp=tp, pp=pp, microbatches=2, schedule=schedule, sequence_parallel=sp,
                                loss_parallel=vocab).model_dump(mode="json", exclude_none=True)
    data["mesh"] = {"tp": tp, "pp": pp, "dp": dp, "cp": cp}
    data["data_parallel"] = {"sharding": sharding}
    if vocab:
        data["tensor_parallel"]["model.embed_tokens"] = "vocab"
    if checkpointing:
        data["activation_checkpointing"] = {"model.layers.*": "full"}
    data["lora"] = {**LORA, "dropout": dropout}
    return data


def _whole(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def _case(name: str, options: dict, kv: int = 2) -> str:
    """One step of the plan `options` describe against PEFT; returns `name` when every check passed."""
    options = dict(options)
    refusals = options.pop("refusals", False)
    bf16 = options.pop("bf16", False)  # the recipe: bfloat16 compute over float32 weights, at its tolerance
    tol = 2e-2 if bf16 else 1e-5
    model = tiny(kv)
    dropout = options.get("dropout", 0.0)
    twin = peft_twin(model, rank=LORA["rank"], alpha=LORA["alpha"], dropout=dropout)
    names = twin_names(model, twin)
    stage = rewrite.apply_plan(model, _plan(model, **options), compute_dtype=torch.bfloat16 if bf16 else None)
    frozen = {n: _whole(p).detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    assert frozen and all(not p.requires_grad for n, p in model.named_parameters() if n in frozen), name
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2)]
    per = len(ids) // stage.dp
    mine = slice(per * stage.dp_rank, per * (stage.dp_rank + 1))
    twin.train(dropout > 0)
    model.train(dropout > 0)
    torch.manual_seed(11)  # dropout: every rank, and then the oracle, draws from the same state
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
    torch.manual_seed(11)
    assert_close(f"{name} loss", loss, reference_step(twin, ids, targets), atol=tol, rtol=tol)
    reference = Renamed(twin, names)
    assert assert_grads_match(model, reference, prefix=f"{name} ", atol=tol) > 0, name
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen), f"{name}: a frozen weight has a gradient"
    total = rewrite.clip_grad_norm_(stage, None)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters() if p.grad is not None]))
    assert_close(f"{name} gradient norm", total, norm, atol=tol, rtol=tol)
    if refusals:
        _outside_a_step(name, model, twin, reference, ids[0])
    torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], lr=1e-2).step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(_whole(p), frozen[n]), f"{name}: frozen {n} changed in the optimizer step"
    if refusals:
        _refuses_what_is_not_built(stage)
    return name


def _outside_a_step(name: str, model, twin, reference, ids) -> None:
    """model(...) and a backward of the caller's own (no run_schedule): the logits, and each backward sums the
    adapters' partial gradients itself."""
    model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    ours, theirs = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert_close(f"{name} model(...) logits", ours, theirs)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    assert assert_grads_match(model, reference, prefix=f"{name} outside a step: ") > 0


def _refuses_what_is_not_built(stage) -> None:
    """Saving a LoRA model as a Hugging Face checkpoint is refused on every rank, before anything is written."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            rewrite.save_pretrained(stage, stage.resolved.plan, f"{tmp}/hf")
        except ValueError as exc:
            assert "is not built yet for LoRA adapters" in str(exc), exc
        else:
            raise AssertionError("a LoRA model's Hugging Face checkpoint was written")


def _cases(rank: int, world: int, cases: list) -> list[str]:
    return [_case(name, options, *extra) for name, options, *extra in cases]


WORLD_2 = [
    ("tp2", {"tp": 2, "refusals": True}),
    ("tp2 sp vocab loss-parallel checkpointed", {"tp": 2, "sp": True, "vocab": True, "checkpointing": True}),
    ("tp2 dropout", {"tp": 2, "dropout": 0.25}),
    ("cp2", {"cp": 2}),
    ("dp2 full", {"dp": 2}),
    ("dp2 replicate", {"dp": 2, "sharding": "replicate"}),
    ("pp2 zero-bubble", {"pp": 2, "schedule": "zero-bubble"}),
    ("tp2 bf16 compute", {"tp": 2, "bf16": True}),
    ("dp2 full bf16 compute", {"dp": 2, "bf16": True}),
]
WORLD_4 = [
    ("tp2 x pp2", {"tp": 2, "pp": 2}),
    ("dp2 full x tp2", {"dp": 2, "tp": 2}),
    ("dp2 replicate x tp2", {"dp": 2, "tp": 2, "sharding": "replicate"}),
    ("tp4 past the kv heads, sp", {"tp": 4, "sp": True}, 2),
]


def test_lora_at_world_2_matches_peft():
    done = run(_cases, 2, WORLD_2, timeout_s=240)
    assert all(len(d) == len(WORLD_2) for d in done), done


def test_lora_at_world_4_matches_peft():
    done = run(_cases, 4, WORLD_4, timeout_s=300)
    assert all(len(d) == len(WORLD_4) for d in done), done
