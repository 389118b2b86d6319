"""gloo's I/O threads as batch threads (`rewrite.mesh.calm_gloo_threads`) against as the system schedules them.

    .venv/bin/python -m bench.gloo_threads                         # about 2.5 minutes on 2 cores
    .venv/bin/python -m bench.gloo_threads --world 4               # about 2 minutes: 4 ranks on the 2 cores
    .venv/bin/python -m bench.gloo_threads --layouts tp2,tp2-sp --steps 9

Each layout of `bench.compile` (eager), and torch's DTensor tp 2 (`parallelize_module`, a
gradient-accumulation loop), is built once in the same two processes (`--world 4`: tp 4, dp 2 x
tp 2 and pp 2 x tp 2 1F1B, every rank stepping the bench batch); every step runs each
layout twice, once with the I/O threads of every process group scheduled SCHED_BATCH (rewrite's
default) and once as the system schedules them (`REWRITE_GLOO_THREADS=default`), the order
swapped every other step. Per layout: the median step of each way (the slower rank's) and the
median of the step-by-step ratios. Writes the "gloo_threads" (or "gloo_threads world 4") entry of
bench/results.json.
"""

from __future__ import annotations

import os
import statistics
import time

import torch.distributed as dist

import rewrite
from bench import common, compile as compiled, tp
from rewrite.mesh import calm_gloo_threads

LAYOUTS = (*compiled.LAYOUTS, "dtensor-tp2")
LAYOUTS_4 = ("tp4", "dp2-tp2", "pp2-tp2")
WAYS = ("batch", "default")


def _set(way: str) -> None:
    if way == "default":
        os.environ["REWRITE_GLOO_THREADS"] = "default"
    else:
        os.environ.pop("REWRITE_GLOO_THREADS", None)
    calm_gloo_threads()


def measure(rank: int, world: int, layouts: tuple[str, ...], warmup: int, steps: int) -> dict:
    """Per layout and way: the seconds of each timed step on this rank."""
    built = {}
    for layout in layouts:
        if layout in LAYOUTS_4:
            built[layout] = _four(layout)
        elif layout == "dtensor-tp2":
            lm = tp._dtensor(world)[0]
            built[layout] = (lm, common.accumulation_step(lm))
        else:
            built[layout] = compiled._ours(rank, layout, compiled=False)
    out = {layout: {way: [] for way in WAYS} for layout in layouts}
    try:
        for i in range(warmup + steps):
            for layout in layouts:
                module, step = built[layout]
                for way in WAYS if i % 2 == 0 else WAYS[::-1]:
                    _set(way)
                    dist.barrier()
                    began = time.perf_counter()
                    step()
                    seconds = time.perf_counter() - began
                    module.zero_grad(set_to_none=True)
                    if i >= warmup:
                        out[layout][way].append(seconds)
    finally:
        _set("batch")
    return out


def _four(layout: str):
    """(module, step) of a 4-rank layout: the decoder layers split as `plan_from_hf` splits them."""
    lm = common.model()
    tp_size = 4 if layout == "tp4" else 2
    plan = {"mesh": {"tp": tp_size, **({"dp": 2} if layout == "dp2-tp2" else {"pp": 2} if layout == "pp2-tp2" else {})},
            "tensor_parallel": rewrite.plan_from_hf(lm, tp=tp_size).tensor_parallel,
            "pipeline": {"microbatches": common.MICROBATCHES, "schedule": "1f1b"}}
    stage = rewrite.apply_plan(lm, plan)
    ids, targets = common.batch()
    return stage.module, lambda: rewrite.run_schedule(stage, ids, targets)


def summarize(ranks: list[dict]) -> dict:
    out = {}
    for layout in ranks[0]:
        slow = {way: [max(r[layout][way][i] for r in ranks) for i in range(len(ranks[0][layout][way]))] for way in WAYS}
        ratios = [a / b for a, b in zip(slow["batch"], slow["default"])]
        out[layout] = {**{f"{way}_s": statistics.median(slow[way]) for way in WAYS},
                       "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
    return out


def table(res: dict) -> str:
    rows = ["| layout | batch threads, s | as the system schedules them, s | ratio, median of steps (range) |",
            "|---|---|---|---|"]
    for layout, r in res.items():
        low, high = r["ratio_range"]
        rows.append(f"| {layout} | {r['batch_s']:.3f} | {r['default_s']:.3f} | {r['ratio']:.2f} ({low:.2f}-{high:.2f}) |")
    return "\n".join(rows)


def main() -> None:
    parser = common.step_parser(__doc__, steps=5, warmup=1, per="layout and way", entry="gloo_threads")
    parser.add_argument("--world", type=int, choices=(2, 4), default=2, help="ranks (4: the layouts of 4 ranks)")
    parser.add_argument("--layouts", help=f"a comma-separated subset of: {', '.join(LAYOUTS + LAYOUTS_4)}; "
                        "writes nothing")
    args = parser.parse_args()
    known = LAYOUTS_4 if args.world == 4 else LAYOUTS
    layouts = tuple(s.strip() for s in args.layouts.split(",")) if args.layouts else known
    unknown = set(layouts) - set(known)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)} at world {args.world}; choose from {', '.join(known)}")
    start = time.time()
    res = summarize(common.launch(measure, args.world, layouts, args.warmup, args.steps))
    print(table(res))
    if not args.layouts:
        key = "gloo_threads" + (" world 4" if args.world == 4 else "")
        common.save_result(args.out, key, {"layouts": res, "steps": args.steps, "wall_s": time.time() - start})


if __name__ == "__main__":
    main()
