"""Training state with DCP: a resumed run is the uninterrupted one, bit for bit, and a checkpoint of
tp 2 x pp 2 resumes under pp 4, tp 4 and dp 2 x tp 2; export gives the same model from any plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import rewrite
from rewrite.checkpoint.export import export_checkpoint
from rewrite.checkpoint.training_state import LATEST, latest_checkpoint, load_training_state, save_training_state
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.multiproc import run

TP_RULES = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel
MICROBATCHES, STEPS, SAVE_AT = 4, 4, 2


def _plan(dp: int = 1, pp: int = 1, tp: int = 1, sharding: str = "full") -> dict:
    return {
        "mesh": {"dp": dp, "pp": pp, "tp": tp},
        "tensor_parallel": TP_RULES if tp > 1 else {},
        "pipeline": {"microbatches": MICROBATCHES // dp, "schedule": "1f1b" if pp > 1 else "afab"},
        "data_parallel": {"sharding": sharding},
    }


def _batch(config, step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = [torch.randint(0, config.vocab_size, (2, 12), generator=gen) for _ in range(MICROBATCHES)]
    return ids, [torch.randint(0, config.vocab_size, (2, 12), generator=gen) for _ in ids]


def _setup(config, plan: dict, seed: int = 0):
    stage = rewrite.apply_plan(build_model(config, seed=seed), plan)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return stage, optimizer, scheduler


def _train(config, plan, first: int, *, setup=None, ckpt=None) -> tuple[dict, tuple]:
    stage, optimizer, scheduler = setup or _setup(config, plan)
    losses = {}
    for step in range(first, STEPS + 1):
        ids, targets = _batch(config, step)
        n = MICROBATCHES // stage.mesh.dp
        mine = slice(stage.mesh.dp_rank * n, (stage.mesh.dp_rank + 1) * n)
        losses[step] = rewrite.run_schedule(stage, ids[mine], targets[mine]).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if ckpt is not None and step == SAVE_AT:
            save_training_state(ckpt, stage, optimizer, scheduler, extra={"step": step, "note": "x"}, keep=1)
    return losses, (stage, optimizer, scheduler)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(stage, optimizer) -> dict:
    out = {f"model/{n}": _local(t) for n, t in stage.model.state_dict().items()}
    names = {id(p): n for n, p in stage.model.named_parameters()}
    for p, state in optimizer.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": _local(v) for k, v in state.items()})
    return out


def _errors(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def _resume_and_reshard(rank: int, world: int, root: str) -> dict:
    config = build_config("tiny-llama", tie_word_embeddings=True)  # tied ends across the pipeline cut
    ckpt, source = Path(root) / "ckpt", _plan(pp=2, tp=2)
    out = {}
    # No checkpoint yet: refused on every rank, before any collective.
    stage, optimizer, scheduler = _setup(config, source)
    out["none"] = _errors(lambda: load_training_state(ckpt, stage, optimizer, scheduler))
    straight, (stage, optimizer, _) = _train(config, source, 1, setup=(stage, optimizer, scheduler), ckpt=ckpt)
    out["straight"], final = straight, _snapshot(stage, optimizer)
    out["latest"] = latest_checkpoint(ckpt)[0]
    # The same plan, another process's worth of fresh objects (other random weights): bit for bit.
    setup = _setup(config, source, seed=7)
    extra = load_training_state(ckpt, *setup)
    out["extra"] = extra
    out["lr_after_load"] = setup[1].param_groups[0]["lr"]
    resumed, (stage, optimizer, _) = _train(config, source, extra["step"] + 1, setup=setup)
    out["resumed"] = resumed
    again = _snapshot(stage, optimizer)
    out["bitwise"] = sorted(k for k in final if not torch.equal(final[k], again[k]))
    out["keys_equal"] = final.keys() == again.keys()
    # Other plans of the same model: resharded weights and optimizer state.
    out["reshard"] = {}
    for name, plan in {"pp4": _plan(pp=4), "tp4": _plan(tp=4), "dp2xtp2": _plan(dp=2, tp=2),
                       "dp2xtp2 replicate": _plan(dp=2, tp=2, sharding="replicate")}.items():
        setup = _setup(config, plan, seed=11)
        extra = load_training_state(ckpt, *setup)
        out["reshard"][name] = _train(config, plan, extra["step"] + 1, setup=setup)[0]
    # A checkpoint of another model is refused, naming tensors.
    other = _setup(build_config("tiny-llama", tie_word_embeddings=True, intermediate_size=96), source)
    out["other_model"] = _errors(lambda: load_training_state(ckpt, *other))
    # A non-fresh optimizer is refused.
    out["used_optimizer"] = _errors(lambda: load_training_state(ckpt, stage, optimizer))
    # Saving the latest step again is refused; a half-written later step is not `latest`.
    out["same_step"] = _errors(lambda: save_training_state(ckpt, stage, optimizer, extra={"step": SAVE_AT}))
    if rank == 0:
        (ckpt / "step-00000009").mkdir()
        (ckpt / "step-00000009" / "__0_0.distcp").write_bytes(b"partial")
    dist.barrier()
    out["latest_after_partial"] = latest_checkpoint(ckpt)[0]
    save_training_state(ckpt, stage, optimizer, extra={"step": 9}, keep=2)  # starts step 9 over
    out["dirs"] = sorted(p.name for p in ckpt.iterdir())
    if rank == 0:
        export_checkpoint(ckpt, Path(root) / "export", step=SAVE_AT)
    return out


@pytest.mark.timeout(400)
def test_resume_is_exact_and_reshards_across_plans(tmp_path):
    results = run(_resume_and_reshard, 4, str(tmp_path), timeout_s=360)
    for rank, out in enumerate(results):
        assert "no checkpoint in" in out["none"] and "start fresh" in out["none"], out["none"]
        assert out["latest"] == SAVE_AT
        assert out["extra"] == {"step": SAVE_AT, "note": "x"}
        assert out["lr_after_load"] == pytest.approx(1e-2)  # the scheduler's warm-up was done by step 2
        for step, loss in out["resumed"].items():
            assert loss == out["straight"][step], (rank, step, loss, out["straight"][step])  # bit for bit
        assert out["keys_equal"] and not out["bitwise"], out["bitwise"]
        for name, losses in out["reshard"].items():
            assert losses.keys() == {3, 4}, name
            for step, loss in losses.items():
                assert abs(loss - out["straight"][step]) <= 1e-5, (name, step, loss, out["straight"][step])
        assert "other whole shapes" in out["other_model"] and "mlp" in out["other_model"], out["other_model"]
        assert "fresh optimizer" in out["used_optimizer"], out["used_optimizer"]
        assert "latest checkpoint already" in out["same_step"], out["same_step"]
        assert out["latest_after_partial"] == SAVE_AT
        assert out["dirs"] == [LATEST, "step-00000002", "step-00000009"], out["dirs"]
    # The export of step 2 is an HF checkpoint whose model equals the training model at step 2.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    reference = _reference_model(build_config("tiny-llama", tie_word_embeddings=True))
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert_close(name, tensor, expected[name])
    initial = build_model(build_config("tiny-llama", tie_word_embeddings=True), seed=0)
    assert not torch.equal(model.model.norm.weight, initial.model.norm.weight)  # trained, not initial


def _reference_model(config):
    """The same SAVE_AT steps in one process, unsharded."""
    model = build_model(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    for step in range(1, SAVE_AT + 1):
        ids, targets = _batch(config, step)
        loss = sum(rewrite.causal_lm_loss(model(input_ids=i).logits, t) for i, t in zip(ids, targets))
        (loss / MICROBATCHES).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return model
