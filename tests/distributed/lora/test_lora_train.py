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


def _trained_logits(tmp: Path) -> dict:
    """The straight run's model read back (its base, its last state) and the exported adapter under PEFT: the
    same logits."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import rewrite

    stage = rewrite.from_pretrained(tmp / "base", {**rewrite.load_plan(TP2).model_dump(mode="json", exclude_none=True),
                                                   "lora": {"rank": 4, "alpha": 8.0}})
    trained = [p for p in stage.parameters() if p.requires_grad]
    rewrite.load_training_state(tmp / "straight" / "ckpt", stage, torch.optim.AdamW(trained))
    ids = torch.randint(0, stage.model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = stage.model(input_ids=ids).logits
        twin = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp / "base"), tmp / "exported")
        theirs = twin(input_ids=ids).logits
    return {"logits": float((ours - theirs).abs().max()), "ids": ids, "ours": ours}


def _runs(rank: int, world: int, tmp: str) -> dict:
    tmp, found = Path(tmp), {}
    straight = train(_config(tmp, TP2, "straight", 4, parity=True, export=str(tmp / "exported")))
    found["parity"], found["straight"] = straight["parity"], straight["losses"]
    found["exported"] = _trained_logits(tmp)
    resumed = train(_config(tmp, TP2, "resumed", 2))["losses"] + train(_config(tmp, PP2, "resumed", 4))["losses"]
    found["resumed"] = resumed
    found["full plan"] = _refused(_config(tmp, PP2, "resumed", 6, lora_rank=None, lora_alpha=None, adapter=None))
    found["other base"] = _refused(_config(tmp, PP2, "resumed", 6, model=str(tmp / "other")))
    found["export"] = _refused(_config(tmp, TP2, "export", 1, export=str(tmp / "hf"), ckpt=None, resume=False,
                                       save_every=0))
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
    assert "a LoRA run exports its adapters (PEFT's format) from its last training state; add --ckpt" in found[
        "export"], found["export"]
    assert found["exported"]["logits"] < 1e-5, found["exported"]
    assert "the run trains no adapters" in found["adapter alone"], found["adapter alone"]
    _merged_is_the_trained_model(tmp_path, found["exported"])


def _merged_is_the_trained_model(tmp: Path, exported: dict) -> None:
    """`rewrite export --merge BASE` writes a plain checkpoint computing what the adapted model computes;
    `--adapter-only` what `train --export` wrote; each refused where it does not apply."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    import rewrite

    ckpt = tmp / "straight" / "ckpt"
    cli = [sys.executable, "-m", "rewrite", "export", str(ckpt)]
    subprocess.run([*cli, str(tmp / "merged"), "--merge", str(tmp / "base")], check=True, capture_output=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged")
    with torch.no_grad():
        assert float((merged(input_ids=exported["ids"]).logits - exported["ours"]).abs().max()) < 1e-5
    rewrite.export_checkpoint(ckpt, tmp / "again", adapter_only=True)
    assert (tmp / "again" / "adapter_model.safetensors").read_bytes() == (
        tmp / "exported" / "adapter_model.safetensors").read_bytes()
    for options, words in [({}, "export the adapters"), ({"base": tmp / "other"}, "is not the base"),
                           ({"adapter_only": True, "base": tmp / "base"}, "export the adapters")]:
        with pytest.raises(rewrite.CheckpointError, match=words):
            rewrite.export_checkpoint(ckpt, tmp / "refused", **options)
