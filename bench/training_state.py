"""Saving and resuming training state (DCP) on the bench model: time, bytes each rank writes, and the
same under other plans on load; `save_pretrained` (weights only, gathered per stage) beside it.

    .venv/bin/python -m bench.training_state          # ~1 minute on 2 cores

Each rank trains one AdamW step under tp 2 x pp 2 (so the optimizer has its moments), then
saves the training state 3 times and `save_pretrained` 3 times, alternating (medians
reported). Then fresh ranks load the latest state under the same plan and under pp 4, tp 4
and dp 2 x tp 2 (3 loads each, fresh optimizers, median).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import rewrite
from bench.common import batch, model
from tests.multiproc import run

TP = dict(rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel)
PLANS = {
    "tp2 x pp2": {"mesh": {"pp": 2, "tp": 2}, "tensor_parallel": TP, "pipeline": {"microbatches": 8}},
    "pp4": {"mesh": {"pp": 4, "tp": 1}, "pipeline": {"microbatches": 8}},
    "tp4": {"mesh": {"pp": 1, "tp": 4}, "tensor_parallel": TP, "pipeline": {"microbatches": 8}},
    "dp2 x tp2": {"mesh": {"dp": 2, "tp": 2}, "tensor_parallel": TP, "pipeline": {"microbatches": 4}},
}
REPEATS = 3


def _stage(plan: dict):
    stage = rewrite.apply_plan(model(), plan)
    return stage, torch.optim.AdamW(stage.parameters(), lr=1e-3)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _save(rank: int, world: int, root: str) -> dict:
    stage, optimizer = _stage(PLANS["tp2 x pp2"])
    ids, targets = batch()
    rewrite.run_schedule(stage, ids, targets)
    optimizer.step()
    state, weights = [], []
    for i in range(REPEATS):
        state.append(_timed(lambda: rewrite.save_training_state(f"{root}/ckpt", stage, optimizer, extra={"step": i + 1},
                                                                keep=1)))
        weights.append(_timed(lambda: rewrite.save_pretrained(stage, PLANS["tp2 x pp2"], f"{root}/hf")))
    mine = sum(p.stat().st_size for p in Path(root, "ckpt", f"step-{REPEATS:08d}").glob(f"__{rank}_*.distcp"))
    return {"state_s": statistics.median(state), "weights_s": statistics.median(weights), "bytes": mine}


def _load(rank: int, world: int, root: str, name: str) -> float:
    times = []
    for _ in range(REPEATS):
        stage, optimizer = _stage(PLANS[name])
        times.append(_timed(lambda: rewrite.load_training_state(f"{root}/ckpt", stage, optimizer)))
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rewrite-bench-state-") as root:
        saved = run(_save, 4, root, timeout_s=600)
        total = sum(r["bytes"] for r in saved)
        per_rank = ", ".join(f"{r['bytes'] / 2**20:.1f}" for r in saved)
        print(f"bench-llama under tp2 x pp2, 4 ranks (median of {REPEATS}):")
        print(f"  save_training_state: {saved[0]['state_s']:.2f} s, {total / 2**20:.1f} MiB in all "
              f"(per rank: {per_rank} MiB)")
        print(f"  save_pretrained (weights only): {saved[0]['weights_s']:.2f} s")
        for name in PLANS:
            seconds = run(_load, 4, root, name, timeout_s=600)[0]
            print(f"  load_training_state under {name}: {seconds:.2f} s")


if __name__ == "__main__":
    main()
