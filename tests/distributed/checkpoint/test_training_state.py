"""Training state with DCP: a resumed run is the uninterrupted one, bit for bit, and a checkpoint of
tp 2 x pp 2 loads under pp 4, tp 4 and dp 2 x tp 2 as exactly the tensors it saved (weights and
AdamW moments); export gives the model that was saved.

Why no comparison here crosses plans after an AdamW step: where a gradient element is near `eps`,
`m / (sqrt(v) + eps)` turns a 1e-9 difference in reduction order (other plans, other CPUs) into an
lr-sized difference of the weights. So AdamW runs are compared bit for bit only under the same plan
(same reduction order); across plans the test compares what involves no optimizer arithmetic:
tensors as loaded (a copy, so bit for bit on any CPU) and the loss of the loaded weights (a forward
pass: reduction-order noise only, ~1e-7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

import rewrite
from rewrite.checkpoint.export import export_checkpoint
from rewrite.checkpoint.training_state import LATEST, latest_checkpoint, load_training_state, save_training_state
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.multiproc import run
from tests.reference import expected_shard

TP_RULES = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel
MICROBATCHES, STEPS, SAVE_AT = 4, 4, 2


def _plan(dp: int = 1, pp: int = 1, tp: int = 1, sharding: str = "full") -> dict:
    return {
        "mesh": {"dp": dp, "pp": pp, "tp": tp},
        "tensor_parallel": TP_RULES if tp > 1 else {},
        "pipeline": {"microbatches": MICROBATCHES // dp, "schedule": "1f1b" if pp > 1 else "afab"},
        "data_parallel": {"sharding": sharding},
    }


# The plans a tp 2 x pp 2 checkpoint is loaded under (the world of 4 ranks each).
RESHARD = {"pp4": _plan(pp=4), "tp4": _plan(tp=4), "dp2xtp2": _plan(dp=2, tp=2),
           "dp2xtp2 replicate": _plan(dp=2, tp=2, sharding="replicate")}


def _batch(config, step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = [torch.randint(0, config.vocab_size, (2, 12), generator=gen) for _ in range(MICROBATCHES)]
    return ids, [torch.randint(0, config.vocab_size, (2, 12), generator=gen) for _ in ids]


def _setup(config, plan: dict, seed: int = 0):
    stage = rewrite.apply_plan(build_model(config, seed=seed), plan)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return stage, optimizer, scheduler


def _train(config, plan, first: int, *, setup=None, ckpt=None, last: int = STEPS) -> tuple[dict, tuple, dict | None]:
    """Steps first..last; with `ckpt`, saves at SAVE_AT and also returns this rank's state as saved."""
    stage, optimizer, scheduler = setup or _setup(config, plan)
    losses, at_save = {}, None
    for step in range(first, last + 1):
        ids, targets = _batch(config, step)
        n = MICROBATCHES // stage.mesh.dp
        mine = slice(stage.mesh.dp_rank * n, (stage.mesh.dp_rank + 1) * n)
        losses[step] = rewrite.run_schedule(stage, ids[mine], targets[mine]).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if ckpt is not None and step == SAVE_AT:
            save_training_state(ckpt, stage, optimizer, scheduler, extra={"step": step, "note": "x"}, keep=1)
            at_save = _snapshot(stage, optimizer)
    return losses, (stage, optimizer, scheduler), at_save


def _whole(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel slice, FSDP2's row shards put back together (collective over dp)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(stage, optimizer) -> dict:
    """This rank's weights and optimizer state under the checkpoint's keys ("model/<fqn>", "optim/<fqn>/<key>")."""
    out = {f"model/{n}": _whole(t) for n, t in stage.model.state_dict().items()}
    names = {id(p): n for n, p in stage.model.named_parameters()}
    for p, state in optimizer.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": _whole(v) for k, v in state.items()})
    return out


def _differ(model, mine: dict, saved: dict) -> list[str]:
    """The keys of this rank's tensors that are not, bit for bit, their slice of the whole saved tensors."""
    out = []
    for key, value in mine.items():
        fqn = key.split("/")[1]
        expected = saved[key] if value.dim() == 0 else expected_shard(model, fqn, saved[key])
        if not torch.equal(value, expected):
            out.append(key)
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
    straight, (stage, optimizer, _), at_save = _train(config, source, 1, setup=(stage, optimizer, scheduler), ckpt=ckpt)
    out["straight"], final = straight, _snapshot(stage, optimizer)
    out["latest"] = latest_checkpoint(ckpt)[0]
    # What was saved, every tensor whole, as torch's own DCP reader (not rewrite's planners) reads it.
    if rank == 0:
        dcp_to_torch_save(ckpt / f"step-{SAVE_AT:08d}", Path(root) / "saved.pt")
    dist.barrier()
    saved = torch.load(Path(root) / "saved.pt", weights_only=False)
    # Every rank's boxes were written where they belong: its state at step 2 is its slice of the whole.
    out["saved_differ"] = _differ(stage.model, at_save, saved)
    # The same plan, another process's worth of fresh objects (other random weights): bit for bit.
    # AdamW's noise amplification cannot act here: the same plan reduces in the same order.
    setup = _setup(config, source, seed=7)
    extra = load_training_state(ckpt, *setup)
    out["extra"] = extra
    out["lr_after_load"] = setup[1].param_groups[0]["lr"]
    resumed, (stage, optimizer, _), _ = _train(config, source, extra["step"] + 1, setup=setup)
    out["resumed"] = resumed
    again = _snapshot(stage, optimizer)
    out["bitwise"] = sorted(k for k in final if not torch.equal(final[k], again[k]))
    out["keys_equal"] = final.keys() == again.keys()
    # Other plans of the same model: the resharded weights and AdamW state (moments and step counts) are,
    # bit for bit, the saved ones (a copy: no arithmetic, so exact on any CPU), and step 3 (the loss of
    # the loaded weights, before any update under the new plan) is the uninterrupted run's step 3.
    # No later step is compared: after an AdamW update under another plan, weights differ by more than noise.
    out["reshard"] = {}
    for name, plan in RESHARD.items():
        setup = _setup(config, plan, seed=11)
        extra = load_training_state(ckpt, *setup)
        loaded = _snapshot(*setup[:2])
        losses, (_, optimizer, _), _ = _train(config, plan, extra["step"] + 1, setup=setup, last=extra["step"] + 1)
        out["reshard"][name] = {
            "compared": sorted(loaded), "differ": _differ(setup[0].model, loaded, saved),
            "lr": setup[1].param_groups[0]["lr"], "losses": losses,
            # AdamW stepped on the resharded state, counting on from the saved step.
            "steps_after": sorted({float(s["step"]) for s in optimizer.state.values()}),
        }
    # A checkpoint of another model is refused, naming tensors.
    other = _setup(build_config("tiny-llama", tie_word_embeddings=True, intermediate_size=96), source)
    out["other_model"] = _errors(lambda: load_training_state(ckpt, *other))
    # A non-fresh optimizer is refused.
    out["used_optimizer"] = _errors(lambda: load_training_state(ckpt, stage, optimizer))
    # Saving the latest step again is refused; a half-written later step is not `latest`.
    out["same_step"] = _errors(lambda: save_training_state(ckpt, stage, optimizer, extra={"step": SAVE_AT}))
    out["bool_step"] = _errors(lambda: save_training_state(ckpt, stage, optimizer, step=True, keep=True))
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
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    tensors = {k for k, v in saved.items() if k.startswith(("model/", "optim/")) and isinstance(v, torch.Tensor)}
    assert any(k.endswith("/exp_avg_sq") for k in tensors) and any(k.endswith("/step") for k in tensors)
    for rank, out in enumerate(results):
        assert "no checkpoint in" in out["none"] and "start fresh" in out["none"], out["none"]
        assert out["latest"] == SAVE_AT
        assert out["saved_differ"] == [], (rank, out["saved_differ"])
        assert out["extra"] == {"step": SAVE_AT, "note": "x"}
        assert out["lr_after_load"] == pytest.approx(1e-2)  # the scheduler's warm-up was done by step 2
        for step, loss in out["resumed"].items():
            assert loss == out["straight"][step], (rank, step, loss, out["straight"][step])  # bit for bit
        assert out["keys_equal"] and not out["bitwise"], out["bitwise"]
        for name, got in out["reshard"].items():
            assert got["differ"] == [], (rank, name, got["differ"])
            assert got["lr"] == pytest.approx(1e-2), (name, got["lr"])
            assert got["losses"].keys() == {SAVE_AT + 1}, name
            loss, want = got["losses"][SAVE_AT + 1], out["straight"][SAVE_AT + 1]
            assert abs(loss - want) <= 1e-5, (name, loss, want)
            assert got["steps_after"] == [SAVE_AT + 1.0], (name, got["steps_after"])
        assert "other whole shapes" in out["other_model"] and "mlp" in out["other_model"], out["other_model"]
        assert "fresh optimizer" in out["used_optimizer"], out["used_optimizer"]
        assert "latest checkpoint already" in out["same_step"], out["same_step"]
        assert "step=True: use a whole number >= 0" in out["bool_step"], out["bool_step"]  # not step-00000001
        assert "keep=True: keep at least 1 checkpoint" in out["bool_step"], out["bool_step"]
        assert out["latest_after_partial"] == SAVE_AT
        assert out["dirs"] == [LATEST, "step-00000002", "step-00000009"], out["dirs"]
    # Every saved tensor was compared on some rank under each plan (a tied lm_head on one stage has its
    # weight under both names but its AdamW state once, under the embedding's name).
    tied_once = {k for k in tensors if k.startswith("optim/lm_head.weight/")}
    for name, plan in RESHARD.items():
        compared = set().union(*(set(out["reshard"][name]["compared"]) for out in results))
        expected = tensors - tied_once if plan["mesh"]["pp"] == 1 else tensors
        assert compared == expected, (name, sorted(expected - compared), sorted(compared - expected))
    # Step 1, before any update, is one process's step on the same microbatches.
    config = build_config("tiny-llama", tie_word_embeddings=True)
    reference = reference_step(build_model(config, seed=0), *_batch(config, 1)).item()
    for out in results:
        assert abs(out["straight"][1] - reference) <= 1e-5, (out["straight"][1], reference)
    # The export of step 2 is an HF checkpoint whose model is, bit for bit, the one saved at step 2
    # (itself, above, each rank's training model at step 2).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    exported = model.state_dict()
    assert {f"model/{n}" for n in exported} == {k for k in tensors if k.startswith("model/")}
    assert [n for n, t in exported.items() if not torch.equal(t, saved[f"model/{n}"])] == []
    initial = build_model(config, seed=0)
    assert not torch.equal(model.model.norm.weight, initial.model.norm.weight)  # trained, not initial


def _load_a_step_directory(rank: int, world: int, root: str) -> dict:
    config, plan, ckpt = build_config("tiny-llama"), _plan(), Path(root) / "ckpt"
    _, (stage, _, _), _ = _train(config, plan, 1, ckpt=ckpt, last=SAVE_AT)
    setup = _setup(config, plan, seed=7)
    extra = load_training_state(ckpt / f"step-{SAVE_AT:08d}", *setup)
    loaded = setup[0].model.state_dict()
    return {"extra": extra, "differ": [n for n, t in stage.model.state_dict().items() if not torch.equal(t, loaded[n])]}


def test_a_step_directory_loads_as_its_run_directory_does(tmp_path):
    out = run(_load_a_step_directory, 1, str(tmp_path), timeout_s=120)[0]
    assert out["extra"] == {"step": SAVE_AT, "note": "x"}, out["extra"]
    assert out["differ"] == [], out["differ"]
