"""Where a measured step goes against the step model's parts, for the plans `bench.planner` last measured.

    .venv/bin/python -m bench.planner_parts            # world 4, bench-llama: about 5 minutes on 2 cores
    .venv/bin/python -m bench.planner_parts --world 2

Reads the "planner" entry of bench/results.json (the profile `rewrite calibrate` measured for that world and the
plans measured on it), runs the same plans again as `bench.planner` does (one alive at a time, one warm-up step
each time one is built, `--steps` timed over two passes), and splits each step of each rank into what
`predict_step` prices apart: `run_schedule` (the table and the data-parallel reduction; predicted `pipeline_s +
dp_s`), the gradient norm's clip and the AdamW update (predicted together, `optimizer_s`), and the barrier that
closes a timed step in `bench.planner` (not predicted). Medians of the slowest rank, milliseconds; the update per rank beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import rewrite
from bench import common
from bench.planner import SEQ
from rewrite.pipeline.grad_norm import clip_grad_norm_
from rewrite.run.calibrate_profile import profile_yaml

PARTS = ("schedule", "clip", "update", "barrier", "step")


def _batches(stage, plan, batch_size: int, vocab: int):
    m, dp = plan.pipeline.microbatches, plan.mesh.dp
    tokens = torch.randint(0, vocab, (dp * m * batch_size, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens[stage.mesh.dp_rank * m * batch_size:(stage.mesh.dp_rank + 1) * m * batch_size]
    ids = [mine[i * batch_size:(i + 1) * batch_size, :-1].contiguous() for i in range(m)]
    return ids, [mine[i * batch_size:(i + 1) * batch_size, 1:].contiguous() for i in range(m)]


def measure(rank: int, world: int, model: str, rows: list[dict], steps: int) -> list[list[tuple]]:
    """Per plan, per timed step: this rank's seconds in each of PARTS, one plan alive at a time, as
    `bench.planner` measures (`common.one_plan_at_a_time`)."""
    def build(j: int):
        plan = rewrite.load_plan(rows[j]["plan"])
        stage = rewrite.apply_plan(common.build_model(model, seed=0), plan)
        ids, targets = _batches(stage, plan, rows[j]["batch_size"], common.build_config(model).vocab_size)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-5)

        def parts() -> tuple:
            dist.barrier()
            t0 = time.perf_counter()
            rewrite.run_schedule(stage, ids, targets)
            t1 = time.perf_counter()
            clip_grad_norm_(stage, 1.0)
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            dist.barrier()
            t4 = time.perf_counter()
            return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0

        return stage, parts

    return common.one_plan_at_a_time(build, len(rows), warmup=1, steps=steps)


def _profile(entry: dict):
    found = {**entry["profile"], "collective_times": entry["collective_times"], "measured": {"p2p": {}, "all_reduce": {}}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.yaml"
        path.write_text(profile_yaml(found, name=f"bench.planner's, {entry['world']} ranks"))
        return rewrite.load_hardware(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_flag(parser)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--results", default="bench/results.json", help="where bench.planner wrote its entry")
    args = parser.parse_args()
    results = json.loads(Path(args.results).read_text())
    entry = next((e for e in results.get(common.result_key("planner", args.model), []) if e["world"] == args.world),
                 None)
    if entry is None:
        parser.error(f"no world {args.world} in {args.results}'s planner entry for {args.model}: "
                     f"run `python -m bench.planner --model {args.model} --worlds {args.world}` first")
    hw, meta, rows = _profile(entry), common.build_model(args.model, device="meta"), entry["rows"]
    per_rank = common.launch(measure, args.world, args.model, rows, args.steps)
    print("| plan | predicted: pipeline + dp, optimizer, step (ms) | measured: schedule, clip, update, barrier, "
          "step (ms) | update per rank (ms) |\n|---|---|---|---|")
    for j, row in enumerate(rows):
        got = rewrite.predict_step(rewrite.resolve(rewrite.load_plan(row["plan"]), meta), meta, hw,
                                   batch_size=row["batch_size"])
        slowest = [statistics.median(max(r[j][i][k] for r in per_rank) for i in range(args.steps)) * 1e3
                   for k in range(len(PARTS))]
        update = [round(statistics.median(step[2] for step in r[j]) * 1e3) for r in per_rank]
        print(f"| {row['summary']} | {(got.pipeline_s + got.dp_s) * 1e3:.0f}, {got.optimizer_s * 1e3:.0f}, "
              f"{got.step_s * 1e3:.0f} | " + ", ".join(f"{v:.0f}" for v in slowest) + f" | {update} |")


if __name__ == "__main__":
    main()
