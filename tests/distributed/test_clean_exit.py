"""A rank that exits right after rewrite's last collective exits cleanly.

gloo's worker threads let go of a collective's tensors just after the caller's `wait()`; a
temporary whose last holder is such a thread, still held when the interpreter shuts down,
aborted the process ("terminate called without an active exception"). rewrite lends every
temporary it hands a collective (`rewrite.lent`) and waits for them at exit. Here: after a
whole round of public operations every lent tensor comes back, promptly, and nothing a
caller keeps (the loss, the stage) was lent.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import rewrite
from rewrite import lent
from rewrite.run.presets import build_model
from tests.multiproc import run

TP2PP2, TP4 = "plans/llama-tp2-pp2.yaml", "plans/llama-tp4.yaml"


def _round_of_public_calls(rank: int, world_size: int, out: str) -> dict:
    torch.manual_seed(0)
    stage = rewrite.apply_plan(build_model("tiny-llama"), TP2PP2)
    lent_by_apply = len(lent._lent)
    ids = torch.randint(0, stage.model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    loss = rewrite.run_schedule(stage, *rewrite.microbatches(ids, 4))
    norm = rewrite.clip_grad_norm_(stage, 1.0)
    rewrite.save_pretrained(stage, TP2PP2, out)
    again = rewrite.from_pretrained(out, TP4)
    begin = time.monotonic()
    left = lent.settle(timeout=5)
    waited = time.monotonic() - begin
    dist.barrier()
    return {"lent_by_apply": lent_by_apply, "left": left, "waited": waited, "loss": float(loss),
            "norm": float(norm), "kept": again is not None and stage is not None}


def test_every_tensor_lent_to_a_collective_comes_back(tmp_path):
    results = run(_round_of_public_calls, 4, str(tmp_path / "hf"), timeout_s=240)
    for rank, r in enumerate(results):
        assert r["lent_by_apply"] > 0, f"rank {rank}: apply_plan's agreement lent nothing"
        assert r["left"] == 0, f"rank {rank}: {r['left']} lent tensor(s) still held (lent while kept elsewhere?)"
        assert r["waited"] < 2.0, f"rank {rank}: settling took {r['waited']:.2f} s"
        assert torch.isfinite(torch.tensor([r["loss"], r["norm"]])).all() and r["kept"]
    assert len({r["loss"] for r in results}) == 1  # the step's loss, the same on every rank
