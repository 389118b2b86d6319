"""`rewrite train --lora-rank` from a Hugging Face base and a PEFT adapter: step 1 against one process with the
same adapters (parity), a run resumed under another plan (tp 2, then pp 2) training what the uninterrupted run
trains, and each refusal: a LoRA state resumed without lora, onto another base, --export, --adapter alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewrite.run.tiny_model import make_tiny_checkpoint
from rewrite.run.train import TrainConfig, train
from tests.multiproc import run
from tests.paths import ROOT

TP2, PP2 = str(ROOT / "plans/llama-tp2.yaml"), str(ROOT / "plans/llama-pp2.yaml")


def _config(tmp: Path, plan: str, tag: str, steps: int, **options) -> TrainConfig:
    settings = {"model": str(tmp / "base"), "lora_rank": 4, "lora_alpha": 8.0, "adapter": str(tmp / "adapter"),
                "steps": steps, "batch_size": 2, "seq_len": 32, "progress": False, "parity": False, "lr": 1e-3,
                "out_dir": str(tmp / tag / "out"), "ckpt": str(tmp / tag / "ckpt"), "resume": True, "save_every": 1,
                **options}
    return TrainConfig(plan, **settings)


def _refused(config: TrainConfig) -> str:
    try:
        train(config)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"rewrite train started: {config}")


def _runs(rank: int, world: int, tmp: str) -> dict:
    tmp, found = Path(tmp), {}
    straight = train(_config(tmp, TP2, "straight", 4, parity=True))
    found["parity"], found["straight"] = straight["parity"], straight["losses"]
    resumed = train(_config(tmp, TP2, "resumed", 2))["losses"] + train(_config(tmp, PP2, "resumed", 4))["losses"]
    found["resumed"] = resumed
    found["full plan"] = _refused(_config(tmp, PP2, "resumed", 6, lora_rank=None, lora_alpha=None, adapter=None))
    found["other base"] = _refused(_config(tmp, PP2, "resumed", 6, model=str(tmp / "other")))
    found["export"] = _refused(_config(tmp, TP2, "export", 1, export=str(tmp / "hf")))
    found["adapter alone"] = _refused(_config(tmp, TP2, "alone", 1, lora_rank=None, lora_alpha=None))
    return found


@pytest.mark.timeout(400)
def test_train_lora_from_a_peft_adapter_resumes_under_another_plan(tmp_path):
    import copy

    from transformers import AutoModelForCausalLM

    from tests.lora_oracle import peft_twin

    make_tiny_checkpoint(tmp_path / "base")
    make_tiny_checkpoint(tmp_path / "other", seed=1)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_twin(copy.deepcopy(base), rank=4, alpha=8.0).save_pretrained(tmp_path / "adapter")
    found = run(_runs, 2, str(tmp_path), timeout_s=360)[0]
    assert found["parity"]["max_dloss"] < 1e-5 and found["parity"]["max_dgrad"] < 1e-5, found["parity"]
    assert found["parity"]["num_params"] == found["parity"]["total_params"] == 2 * 7 * 2 * 2, found["parity"]
    straight, resumed = found["straight"], found["resumed"]
    assert len(straight) == len(resumed) == 4 and max(abs(a - b) for a, b in zip(straight, resumed)) < 1e-5, found
    assert "holds a LoRA training state" in found["full plan"], found["full plan"]
    assert "trained on another base model" in found["other base"], found["other base"]
    assert "--export" in found["export"] and "not built yet" in found["export"], found["export"]
    assert "the run trains no adapters" in found["adapter alone"], found["adapter alone"]
