"""`rewrite train` on packed chat data, where every row trains another number of tokens: a run resumed
under plans that split the same global batch otherwise (cp 2 x tp 2 as 2 x 2 rows -> tp 2 x pp 2 as
4 x 1 -> dp 2 x pp 2 as 2 x (2 x 1)) trains what the uninterrupted run trains, loss for loss within
1e-5; the same with one example a row (`pack=False`); step 1 matches one process (parity). At a
fine-tuning learning rate: at a from-scratch one, AdamW's `m / (sqrt(v) + eps)` turns other plans'
reduction order (~1e-9) into lr-sized weight differences where a gradient is near eps."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewrite.run.tiny_model import make_tiny_checkpoint
from rewrite.run.train import TrainConfig, train
from tests.multiproc import run
from tests.paths import ROOT

STEPS = 6
DP2_PP2 = "mesh: {dp: 2, pp: 2}\npipeline: {microbatches: 2, schedule: 1f1b}\n"
PLANS = {"cp2 x tp2": (str(ROOT / "plans/llama-cp2-tp2.yaml"), 2),  # (plan, rows a microbatch): 4 rows a step
         "tp2 x pp2": (str(ROOT / "plans/llama-tp2-pp2.yaml"), 1), "dp2 x pp2": (None, 1)}


def _train(tmp: Path, name: str, tag: str, steps: int, pack: bool, parity: bool = False) -> dict:
    plan, rows = PLANS[name]
    return train(TrainConfig(
        plan or str(tmp / "dp2-pp2.yaml"), model=str(tmp / "tiny"), data=str(ROOT / "data/chat-sums.jsonl"),
        pack=pack, steps=steps, batch_size=rows, seq_len=64, progress=False, parity=parity, lr=5e-5,
        out_dir=str(tmp / tag / "out"), ckpt=str(tmp / tag / "ckpt"), resume=True, save_every=1))


def _runs(rank: int, world: int, tmp: str) -> dict:
    tmp, found = Path(tmp), {}
    for pack, order in ((True, ["cp2 x tp2", "tp2 x pp2", "dp2 x pp2"]), (False, ["tp2 x pp2", "dp2 x pp2", "cp2 x tp2"])):
        tag = "packed" if pack else "one a row"
        straight = _train(tmp, order[0], f"{tag} straight", STEPS, pack, parity=pack)
        if pack:
            found["parity"] = straight["parity"]
        losses = []
        for i, name in enumerate(order):  # two steps under each plan, resumed from the one before
            losses += _train(tmp, name, f"{tag} resumed", 2 * (i + 1), pack)["losses"]
        found[tag] = (straight["losses"], losses)
    return found


@pytest.mark.timeout(600)
def test_a_resume_under_another_split_trains_what_the_uninterrupted_run_trains(tmp_path):
    make_tiny_checkpoint(tmp_path / "tiny")
    (tmp_path / "dp2-pp2.yaml").write_text(DP2_PP2)
    found = run(_runs, 4, str(tmp_path), timeout_s=540)[0]
    assert found["parity"]["max_dloss"] < 1e-5 and found["parity"]["max_dgrad"] < 1e-5, found["parity"]
    for tag in ("packed", "one a row"):
        straight, resumed = found[tag]
        assert len(straight) == len(resumed) == STEPS, (tag, straight, resumed)
        worst = max(abs(a - b) for a, b in zip(straight, resumed))
        assert worst < 1e-5, f"{tag}: the resumed run drifts by {worst:.2e}: {straight} vs {resumed}"
