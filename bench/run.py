"""Run every benchmark side by side and write bench/results.json.

    .venv/bin/python -m bench.run            # about 11 minutes on 2 cores
    .venv/bin/python -m bench.run --steps 3  # a quick look

Prints markdown tables of medians and ratios (the numbers in BENCHMARKS.md); the
per-schedule pipeline comparison alone is `python -m bench.schedules`, data parallelism alone
`python -m bench.dp`, the tensor-parallel options alone `python -m bench.tp_options`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from bench import common, dp, pp, schedules, tp, tp_options


def _machine() -> dict:
    cpu = "unknown"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "backend": "gloo",
    }


def main() -> None:
    parser = common.step_parser(__doc__, steps=7, per="implementation")
    parser.add_argument("--out", default="bench/results.json")
    args = parser.parse_args()
    start = time.time()
    res: dict = {"machine": _machine(), "model": common.MODEL, "seq": common.SEQ,
                 "microbatches": common.MICROBATCHES, "microbatch_size": common.MB, "steps": args.steps}

    single = common.single_process(pp.one_process, args.warmup, args.steps)
    pp_runs = common.launch(pp.timing, 2, args.warmup, args.steps)
    # The same comparison with the cut moved to balance the LM head's cost (5 + 3 layers).
    pp_cut5 = common.launch(pp.timing, 2, args.warmup, args.steps, 5)
    # Each schedule against its torch.distributed.pipelining counterpart (bench.schedules).
    sched_runs = common.launch(schedules.compare, 2, args.warmup, args.steps)
    tp_runs = common.launch(tp.timing, 2, args.warmup, args.steps)
    dp_runs = common.launch(dp.compare, 2, args.warmup, args.steps)  # bench.dp: DDP / FSDP2 side by side
    # bench.tp_options: vocab / loss_parallel / sequence_parallel / checkpointing, DTensor, one process.
    tp_opt_runs = common.launch(tp_options.compare, 2, args.warmup, args.steps)
    mem = {
        "pp_ours": common.launch(pp.memory, 2, "ours"),
        "pp_gpipe": common.launch(pp.memory, 2, "gpipe"),
        "tp_ours": common.launch(tp.memory, 2, "ours"),
        "tp_dtensor": common.launch(tp.memory, 2, "dtensor"),
    }
    one = common.median(single["times"])
    # A step ends when its slowest rank ends: take the per-step max over ranks.
    pp_ours = common.median([max(r["ours"][i] for r in pp_runs) for i in range(args.steps)])
    pp_gpipe = common.median([max(r["gpipe"][i] for r in pp_runs) for i in range(args.steps)])
    cut5_ours = common.median([max(r["ours"][i] for r in pp_cut5) for i in range(args.steps)])
    cut5_gpipe = common.median([max(r["gpipe"][i] for r in pp_cut5) for i in range(args.steps)])
    tp_ours = common.median([max(r["ours"][i] for r in tp_runs) for i in range(args.steps)])
    tp_dt = common.median([max(r["dtensor"][i] for r in tp_runs) for i in range(args.steps)])
    m, p = common.MICROBATCHES, 2
    busy = [common.median(r["busy"]) for r in pp_runs]
    res.update(
        one_process={"median_s": one, "times": single["times"], "param_bytes": single["param_bytes"],
                     "peak_rss_mib": single["peak_rss_mib"]},
        pp={"ours_median_s": pp_ours, "gpipe_median_s": pp_gpipe, "ratio_ours_gpipe": pp_ours / pp_gpipe,
            "speedup_vs_one_process": one / pp_ours, "busy_fraction": busy,
            "busy_theoretical": m / (m + p - 1), "raw": pp_runs,
            "cut5": {"ours_median_s": cut5_ours, "gpipe_median_s": cut5_gpipe,
                     "ratio_ours_gpipe": cut5_ours / cut5_gpipe,
                     "busy_fraction": [common.median(r["busy"]) for r in pp_cut5], "raw": pp_cut5}},
        tp={"ours_median_s": tp_ours, "dtensor_median_s": tp_dt, "ratio_ours_dtensor": tp_ours / tp_dt,
            "ratio_ours_one_process": tp_ours / one,
            "collectives_ours": tp_runs[0]["collectives_ours"],
            "collectives_dtensor": tp_runs[0]["collectives_dtensor"], "raw": tp_runs},
        memory=mem,
        schedules=schedules.summarize(sched_runs, one),
        dp=dp.summarize(dp_runs, single["times"]),
        tp_options=tp_options.summarize(tp_opt_runs),
        ideal_param_bytes_per_rank=single["param_bytes"] / 2,
        wall_s=time.time() - start,
    )
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    print()
    print(schedules.table(res["schedules"]))
    print()
    print(dp.table(res["dp"]))
    print()
    print(tp_options.table(res["tp_options"]))
    print()
    print(tp_options.targets(res["tp_options"]))


def table(res: dict) -> str:
    pp_, tp_, mem = res["pp"], res["tp"], res["memory"]
    ideal = res["ideal_param_bytes_per_rank"] / 2**20
    lines = [
        "| measurement | ours | reference | ratio | target |",
        "|---|---|---|---|---|",
        f"| PP=2 AFAB step (s) vs ScheduleGPipe | {pp_['ours_median_s']:.3f} | {pp_['gpipe_median_s']:.3f} "
        f"| {pp_['ratio_ours_gpipe']:.2f} | <= 0.90 |",
        f"| PP=2 step vs one process, 1 thread (s) | {pp_['ours_median_s']:.3f} | {res['one_process']['median_s']:.3f} "
        f"| {pp_['ours_median_s'] / res['one_process']['median_s']:.2f} | |",
        f"| PP=2 cut at layer 5 (5 + 3 layers) vs ScheduleGPipe, same cut | {pp_['cut5']['ours_median_s']:.3f} "
        f"| {pp_['cut5']['gpipe_median_s']:.3f} | {pp_['cut5']['ratio_ours_gpipe']:.2f} | |",
        f"| PP busy fraction, cut at 5 (rank 0, rank 1) | {pp_['cut5']['busy_fraction'][0]:.3f}, "
        f"{pp_['cut5']['busy_fraction'][1]:.3f} | {pp_['busy_theoretical']:.3f} "
        f"| {min(pp_['cut5']['busy_fraction']) / pp_['busy_theoretical']:.2f} | |",
        f"| PP busy fraction (rank 0, rank 1) vs m/(m+p-1) | {pp_['busy_fraction'][0]:.3f}, {pp_['busy_fraction'][1]:.3f} "
        f"| {pp_['busy_theoretical']:.3f} | {min(pp_['busy_fraction']) / pp_['busy_theoretical']:.2f} | >= 0.95 |",
        f"| TP=2 step (s) vs DTensor | {tp_['ours_median_s']:.3f} | {tp_['dtensor_median_s']:.3f} "
        f"| {tp_['ratio_ours_dtensor']:.2f} | <= 0.50 |",
        f"| TP=2 step (s) vs one process, 1 thread | {tp_['ours_median_s']:.3f} | {res['one_process']['median_s']:.3f} "
        f"| {tp_['ratio_ours_one_process']:.2f} | < 1.00 |",
    ]
    for name in sorted(set(tp_["collectives_ours"]) | set(tp_["collectives_dtensor"])):
        o = tp_["collectives_ours"].get(name, {"count": 0, "bytes": 0})
        d = tp_["collectives_dtensor"].get(name, {"count": 0, "bytes": 0})
        lines.append(
            f"| TP {name} per step: count (MiB) | {o['count']} ({o['bytes'] / 2**20:.1f}) "
            f"| {d['count']} ({d['bytes'] / 2**20:.1f}) | | |"
        )
    for key, label in (("pp_ours", "PP ours"), ("pp_gpipe", "PP GPipe"), ("tp_ours", "TP ours"), ("tp_dtensor", "TP DTensor")):
        params = ", ".join(f"{r['param_bytes'] / 2**20:.1f}" for r in mem[key])
        rss = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in mem[key])
        lines.append(f"| {label}: param MiB per rank (ideal {ideal:.1f}); peak RSS MiB | {params}; {rss} | | | |")
    lines.append(f"| one process: param MiB; peak RSS MiB | {res['one_process']['param_bytes'] / 2**20:.1f}; "
                 f"{res['one_process']['peak_rss_mib']:.0f} | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
