"""`rewrite plan --measure K` on the bench model, and what its corrected profile does for the next plan.

    .venv/bin/python -m bench.plan_measure                 # about 8 minutes on 2 cores
    .venv/bin/python -m bench.plan_measure --worlds 2 --measure 4 --model bench-qwen3-moe

For each world (local ranks, one thread each): `rewrite calibrate` measures this machine; `rewrite
plan --measure K --profile corrected.yaml` times its top K plans for the bench model (seq_len 128, a
global batch of 16 sequences) and writes the corrected profile; a second `rewrite plan --measure K
--hardware corrected.yaml` then predicts from the corrected profile and times its own top K. Each
run's predicted against measured: the median and worst |measured / predicted - 1|, and whether the
measured pick differs from the predicted top. Writes the "plan_measure" entry of bench/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common
from rewrite.run.calibrate import calibrate, profile_yaml

SEQ, BATCH = 128, 16


def plan(model: str, world: int, hardware: Path, measure: int, profile: Path | None) -> dict:
    """`rewrite plan --measure` as a user runs it; its JSON."""
    cmd = [sys.executable, "-m", "rewrite", "plan", "--model", model, "--world", str(world), "--seq-len",
           str(SEQ), "--global-batch", str(BATCH), "--hardware", str(hardware), "--measure", str(measure), "--json",
           *(["--profile", str(profile)] if profile else [])]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if run.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def summary(found: dict) -> dict:
    plans = found["measured"]["plans"]
    gaps = sorted(abs(p["measured_s"] / p["predicted_s"] - 1) for p in plans)
    fixed = sorted(abs(p["measured_s"] / p["corrected_s"] - 1) for p in plans)
    return {"plans": plans, "fastest": found["measured"]["fastest"], "scales": found["measured"]["scales"],
            "median_error": common.median(gaps), "worst_error": gaps[-1],
            "median_error_corrected": common.median(fixed), "worst_error_corrected": fixed[-1],
            "top_pick_over_fastest": plans[0]["measured_s"] / min(p["measured_s"] for p in plans)}


def run_world(model: str, world: int, measure: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        calibrated, corrected = Path(folder) / "calibrated.yaml", Path(folder) / "corrected.yaml"
        calibrated.write_text(profile_yaml(calibrate(world), name=f"this machine, {world} ranks"))
        first = summary(plan(model, world, calibrated, measure, corrected))
        second = summary(plan(model, world, corrected, measure, None))
        return {"model": model, "world": world, "first": first, "second": second,
                "corrected_profile": corrected.read_text()}


def table(res: dict) -> str:
    lines = [f"{res['model']}, world {res['world']}"]
    for name, what in (("first", "calibrated profile"), ("second", "the profile the first run corrected")):
        r = res[name]
        lines += ["", f"{name} run, on {what}: scales compute x{r['scales']['compute']:.3g}, communication "
                  f"x{r['scales']['communication']:.3g} ({r['scales']['how']})", "",
                  "| # | plan | predicted (s) | measured (s) | measured / predicted |", "|---|---|---|---|---|"]
        for p in r["plans"]:
            mark = " **(fastest measured)**" if p["index"] == r["fastest"] else ""
            lines.append(f"| {p['index'] + 1} | {p['summary']}{mark} | {p['predicted_s']:.3f} | {p['measured_s']:.3f} "
                         f"| {p['measured_s'] / p['predicted_s']:.2f} |")
        lines.append(f"\n|measured / predicted - 1|: median {r['median_error']:.0%}, worst {r['worst_error']:.0%}; "
                     f"after this run's own fit {r['median_error_corrected']:.0%}, {r['worst_error_corrected']:.0%}; "
                     f"top pick / fastest measured {r['top_pick_over_fastest']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_flag(parser)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--measure", type=int, default=4)
    parser.add_argument("--out", default="bench/results.json",
                        help="its 'plan_measure' entry (a list per model: 'plan_measure bench-qwen3-moe', ...) is replaced")
    args = parser.parse_args()
    found = [run_world(args.model, int(w), args.measure) for w in args.worlds.split(",")]
    for res in found:
        print(table(res) + "\n", flush=True)
    common.save_result(args.out, common.result_key("plan_measure", args.model), found)


if __name__ == "__main__":
    main()
