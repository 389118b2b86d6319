"""PP = 2, schedule by schedule: rewrite's run_schedule against torch.distributed.pipelining.

    .venv/bin/python -m bench.schedules            # about 1 minute on 2 cores
    .venv/bin/python -m bench.schedules --steps 3  # a quick look

afab runs against `ScheduleGPipe`, 1f1b against `Schedule1F1B`, on the same two stages
(layers [0, 4) and [4, 8)), all four in the same two processes, alternating step by step.
Per schedule: step time, and memory per rank measured two ways on both sides:
the most bytes of saved activations alive at once (`common.SavedTensors`), and the most
bytes of tensor memory a step allocates and holds at once (`common.allocation_peak`).
Writes the "schedules" entry of bench/results.json (`bench.run` runs it too).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch.distributed as dist

from bench import common, pp

SCHEDULES = tuple(pp.TORCH_SCHEDULES)  # ("afab", "1f1b")
PP = 2


def compare(rank: int, world: int, warmup: int, steps: int, cut: int = 4) -> dict:
    """Times of every step of the four pipelines, then one measured step each for memory."""
    runs, kept = {}, {}
    for name in SCHEDULES:
        stage, step, _ = pp._ours(rank, world, cut, name)
        runs[f"rewrite {name}"] = (stage.module, step)
        carved, step, torch_stage = pp._torch_pipeline(rank, world, cut, name)
        runs[f"torch {name}"] = (carved, step)
        kept[f"torch {name}"] = torch_stage
    keys = list(runs)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for i in range(warmup + steps):
        # Alternate, so drift affects all four alike; every other round in reverse, so none always goes first.
        for key in keys if i % 2 == 0 else keys[::-1]:
            t = common.timed(runs[key][1], warmup=0, steps=1)[0]
            if i >= warmup:
                times[key].append(t)
    memory = {}
    for key, (module, step) in runs.items():
        dist.barrier()
        saved = common.SavedTensors(module)
        with saved.hooks():
            allocated = common.allocation_peak(step)
        memory[key] = {
            "saved_peak_bytes": saved.peak,
            "allocated_peak_bytes": allocated,
            "param_bytes": common.param_bytes(module),
            "kept_between_steps_bytes": _kept_bytes(kept[key]) if key in kept else 0,
        }
    return {"times": times, "memory": memory}


def _kept_bytes(stage) -> int:
    """Receive buffers (and the input gradients on them) a torch PipelineStage keeps from step to step."""
    total = 0
    for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
        for info in infos:
            for t in (info.buffer, getattr(info.buffer, "grad", None)):
                if t is not None:
                    total += t.numel() * t.element_size()
    return total


def summarize(runs: list[dict], one_process_s: float) -> dict:
    """Medians over steps of the slowest rank, ratios, and the memory targets."""
    m = common.MICROBATCHES
    steps = len(runs[0]["times"]["rewrite afab"])
    out: dict = {"pp": PP, "microbatches": m, "one_process_median_s": one_process_s, "raw": runs}
    for name in SCHEDULES:
        entry: dict = {"torch_schedule": pp.TORCH_SCHEDULES[name]}
        for impl in ("rewrite", "torch"):
            key = f"{impl} {name}"
            # A step ends when its slowest rank ends.
            per_step = [max(r["times"][key][i] for r in runs) for i in range(steps)]
            entry[impl] = {
                "median_s": common.median(per_step),
                "min_s": min(per_step),
                "max_s": max(per_step),
                "vs_one_process": common.median(per_step) / one_process_s,
                "saved_peak_bytes": [r["memory"][key]["saved_peak_bytes"] for r in runs],
                "allocated_peak_bytes": [r["memory"][key]["allocated_peak_bytes"] for r in runs],
                "param_bytes": [r["memory"][key]["param_bytes"] for r in runs],
                "kept_between_steps_bytes": [r["memory"][key]["kept_between_steps_bytes"] for r in runs],
            }
        entry["ratio_rewrite_torch"] = entry["rewrite"]["median_s"] / entry["torch"]["median_s"]
        paired = [
            max(r["times"][f"rewrite {name}"][i] for r in runs) / max(r["times"][f"torch {name}"][i] for r in runs)
            for i in range(steps)
        ]
        entry["ratio_per_step_min_max"] = [min(paired), max(paired)]
        out[name] = entry
    # 1F1B's target: per rank, activations <= pp/m of AFAB's, plus the model (its parameter bytes).
    # Checked on saved activations (the target) and, for information, on everything a step allocates.
    for impl in ("rewrite", "torch"):
        afab, ofob = out["afab"][impl], out["1f1b"][impl]
        for what in ("saved", "allocated"):
            peak = ofob[f"{what}_peak_bytes"]
            bound = [PP / m * a + p for a, p in zip(afab[f"{what}_peak_bytes"], ofob["param_bytes"])]
            ofob[f"{what}_bound_bytes"] = bound
            ofob[f"{what}_vs_afab"] = [o / a for o, a in zip(peak, afab[f"{what}_peak_bytes"])]
            ofob[f"{what}_within_bound"] = [o <= b for o, b in zip(peak, bound)]
        ofob["memory_target_met"] = all(ofob["saved_within_bound"])
    return out


def table(res: dict) -> str:
    mib = 2**20

    def per_rank(values, scale=mib, fmt="{:.1f}"):
        return ", ".join(fmt.format(v / scale) for v in values)

    lines = [
        "| schedule | impl | step median (min-max) | rewrite / torch | vs one process | "
        "saved activations, peak MiB per rank | allocated in step, peak MiB per rank | "
        "kept between steps MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in SCHEDULES:
        e = res[name]
        for impl in ("rewrite", "torch"):
            r = e[impl]
            label = "rewrite" if impl == "rewrite" else f"torch `{e['torch_schedule']}`"
            ratio = f"{e['ratio_rewrite_torch']:.2f} ({e['ratio_per_step_min_max'][0]:.2f}-" \
                    f"{e['ratio_per_step_min_max'][1]:.2f})" if impl == "rewrite" else ""
            lines.append(
                f"| {name} | {label} | {r['median_s']:.3f} s ({r['min_s']:.3f}-{r['max_s']:.3f}) | {ratio} "
                f"| {r['vs_one_process']:.2f} | {per_rank(r['saved_peak_bytes'])} "
                f"| {per_rank(r['allocated_peak_bytes'])} | {per_rank(r['kept_between_steps_bytes'])} |"
            )
    m = res["microbatches"]
    lines.append("")
    lines.append(f"1F1B memory per rank against {res['pp']}/{m} x AFAB's + parameter bytes "
                 f"(target: saved activations)")
    for impl in ("rewrite", "torch"):
        o = res["1f1b"][impl]
        for what in ("saved", "allocated"):
            lines.append(
                f"  {impl}, {what}: 1f1b {per_rank(o[f'{what}_peak_bytes'])} MiB, bound "
                f"{per_rank(o[f'{what}_bound_bytes'])} MiB: "
                f"{', '.join('within' if ok else 'OVER' for ok in o[f'{what}_within_bound'])}; "
                f"1f1b / afab {per_rank(o[f'{what}_vs_afab'], 1, '{:.3f}')} (pp/m = {res['pp'] / m:.3f})"
            )
    lines.append(f"one process, 1 thread: {res['one_process_median_s']:.3f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--out", default="bench/results.json", help="its 'schedules' entry is replaced")
    args = parser.parse_args()
    start = time.time()
    single = common.single_process(pp.one_process, args.warmup, args.steps)
    runs = common.launch(compare, PP, args.warmup, args.steps)
    res = summarize(runs, common.median(single["times"]))
    res["one_process_times"] = single["times"]
    res["wall_s"] = time.time() - start
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results["schedules"] = res
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
