"""A step whose loss or gradient norm is nan or inf is never applied nor saved: `rewrite train
--on-nonfinite stop|skip`, and `save_training_state` refusing a diverged state."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import rewrite
from rewrite.checkpoint.finite import NonFiniteState
from rewrite.checkpoint.training_state import latest_checkpoint
from rewrite.run import train_loop as train_module  # where the steps call run_schedule
from rewrite.run.guard import TrainStopped
from rewrite.run.presets import build_model
from rewrite.run.train import TrainConfig, train
from tests.distributed.run.test_demo import torchrun
from tests.multiproc import run

STOPPED = re.compile(r"rewrite train stopped at step (\d+): ")


def _strict_lines(path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"{path} holds {constant}, which strict JSON readers refuse")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_diverging_run_stops_before_saving_its_nan_state(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    done = torchrun(2, "train", "plans/llama-pp2.yaml", "--steps", "10", "--seq-len", "32", "--lr", "1e3",
                    "--ckpt", str(ckpt), "--save-every", "1", "--keep", "2", "--out", str(out), "--no-parity",
                    "--no-progress", timeout_s=200)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-3000:]
    stops = STOPPED.findall(said)
    assert len(stops) == 1, said[-3000:]  # said once, by rank 0
    step = int(stops[0])
    assert step >= 2, said[-3000:]
    latest = latest_checkpoint(ckpt)
    assert latest is not None and latest[0] == step - 1, (latest, said[-3000:])
    assert f"The last finite training state is {latest[1]} (step {step - 1})" in said
    assert "try a lower --lr (this run's: 1000)" in said
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{s:08d}" for s in range(max(1, step - 2), step)]
    exported = rewrite.export_checkpoint(ckpt, tmp_path / "hf")
    weights = load_file(str(exported / "model.safetensors"))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    lines = _strict_lines(out / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, step + 1))
    assert lines[-1]["applied"] is False and lines[-1]["skipped_steps"] == 1
    assert all(line["applied"] for line in lines[:-1])


def _poisoning(poison: set[int], seen: dict):
    """run_schedule, with a nan gradient on rank 1 alone in the steps of `poison` (1-based calls); records
    the parameters each call starts from."""
    real = train_module.run_schedule

    def step(stage, inputs, targets):
        seen["calls"] += 1
        seen.setdefault("starts", []).append([p.detach().clone() for p in stage.parameters()])
        loss = real(stage, inputs, targets)
        if seen["calls"] in poison and torch.distributed.get_rank() == 1:
            next(p for p in stage.parameters() if p.grad is not None).grad[0] = float("nan")
        return loss

    return step


def _config(tmp, name: str, **kw) -> TrainConfig:
    return TrainConfig("plans/llama-pp2.yaml", steps=6, batch_size=2, seq_len=32, ckpt=str(tmp / name / "ckpt"),
                       out_dir=str(tmp / name / "out"), parity=False, progress=False, **kw)


_REAL = train_module.run_schedule


def _train(config: TrainConfig, poison: set[int]):
    seen = {"calls": 0}
    train_module.run_schedule = _poisoning(poison, seen)
    try:
        return train(config), seen, None
    except TrainStopped as stopped:
        return None, seen, str(stopped)
    finally:
        train_module.run_schedule = _REAL


def _cases(rank: int, ws: int, tmp) -> dict:
    got = {}
    # stop (the default): nan on one rank at step 3 stops every rank; step 2's state is the latest.
    _, seen, message = _train(_config(tmp, "stop", save_every=1, keep=2), {3})
    got["stop"] = (message, latest_checkpoint(tmp / "stop" / "ckpt")[0], seen["calls"])
    # skip: steps 3 and 4 are not applied; step 5 starts from step 2's weights; the run ends.
    metrics, seen, message = _train(_config(tmp, "skip", save_every=2, on_nonfinite="skip", skip_limit=3), {3, 4})
    same = all(torch.equal(a, b) for a, b in zip(seen["starts"][2], seen["starts"][4]))
    moved = not all(torch.equal(a, b) for a, b in zip(seen["starts"][1], seen["starts"][2]))
    got["skip"] = (message, metrics and metrics["skipped_steps"], same, moved,
                   sorted(p.name for p in (tmp / "skip" / "ckpt").glob("step-*")))
    # skip, but the limit in a row is reached.
    _, seen, message = _train(_config(tmp, "limit", on_nonfinite="skip", skip_limit=3), {2, 3, 4})
    got["limit"] = (message, seen["calls"])
    # the library: a nan parameter on one rank is refused on every rank, nothing written.
    stage = rewrite.apply_plan(build_model("tiny-llama"), "plans/llama-pp2.yaml")
    optimizer = torch.optim.AdamW(stage.parameters())
    rewrite.save_training_state(tmp / "lib", stage, optimizer, extra={"step": 1})
    if rank == 0:
        with torch.no_grad():
            next(stage.parameters())[0] = float("inf")
    try:
        rewrite.save_training_state(tmp / "lib", stage, optimizer, extra={"step": 2})
        got["library"] = None
    except NonFiniteState as refused:
        got["library"] = (str(refused), latest_checkpoint(tmp / "lib")[0], (tmp / "lib" / "step-00000002").exists())
    return got


def test_nonfinite_steps_are_never_applied_on_any_rank(tmp_path):
    first, second = run(_cases, 2, tmp_path, timeout_s=240)
    assert first == second, "every rank decides alike"
    message, latest, calls = first["stop"]
    assert message.startswith("rewrite train stopped at step 3: the loss is ") and "gradient norm nan" in message
    assert (latest, calls) == (2, 3)
    assert f"The last finite training state is {tmp_path / 'stop' / 'ckpt' / 'step-00000002'} (step 2)" in message
    assert "or --on-nonfinite skip" in message
    lines = _strict_lines(tmp_path / "stop" / "out" / "metrics.jsonl")
    assert [(line["step"], line["applied"], line["grad_norm"]) for line in lines][-1] == (3, False, None)
    assert first["skip"] == (None, 2, True, True, ["step-00000002", "step-00000004", "step-00000006"])
    lines = _strict_lines(tmp_path / "skip" / "out" / "metrics.jsonl")
    assert [line["applied"] for line in lines] == [True, True, False, False, True, True]
    assert [line["skipped_steps"] for line in lines] == [0, 0, 1, 2, 2, 2]
    metrics = json.loads((tmp_path / "skip" / "out" / "metrics.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"metrics.json holds {c}"))
    assert metrics["skipped_steps"] == 2
    message, calls = first["limit"]
    assert message.startswith("rewrite train stopped at step 4: 3 steps in a row (steps 2-4) were not finite, "
                              "the limit --skip-limit 3") and calls == 4
    assert f"{tmp_path / 'limit' / 'ckpt'} holds no checkpoint yet, so there is nothing to resume from" in message
    refused, latest, written = first["library"]
    assert "hold nan or inf: the run has diverged, and its state is not saved" in refused
    assert "rank 0: model.embed_tokens.weight" in refused, refused
    assert (latest, written) == (1, False)
