"""Where a step's time goes: torch.profiler summaries of our TP and PP steps.

    .venv/bin/python -m bench.profile tp          # top operators, TP=2
    .venv/bin/python -m bench.profile pp          # top operators, PP=2
    .venv/bin/python -m bench.profile tp-sums     # TP: time in the sums, and the step without them
    .venv/bin/python -m bench.profile pp-path     # PP: the critical path from the timeline
    .venv/bin/python -m bench.profile pp-path --schedule 1f1b   # the same under 1F1B (also: pp)
    .venv/bin/python -m bench.profile pp-path --schedule zbv    # virtual stages: busy time per rank
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from bench import common, pp, tp


def _summary(prof, rows: int) -> dict:
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gloo = sum(e.self_cpu_time_total for e in events if e.key.startswith("gloo:"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return {
        "total_ms": total / 1e3,
        "gloo_ms": gloo / 1e3,
        "top": [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in top],
    }


def _profile_tp(rank: int, world: int, rows: int) -> dict:
    _, step = tp._ours(world)
    step()  # warm up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return _summary(prof, rows)


def _profile_pp(rank: int, world: int, rows: int, schedule: str = "afab") -> dict:
    _, step, _ = pp._ours(rank, world, 4, schedule)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return _summary(prof, rows)


def _tp_sums(rank: int, world: int, rows: int) -> dict:
    """Each sum's wall time in a TP step, then the same step with the sums skipped."""
    from rewrite.tensor_parallel import comm

    _, step = tp._ours(world)
    original, waits = comm.all_reduce_sum, []

    def timed(x, group=None):
        start = time.perf_counter()
        out = original(x, group)
        waits.append(time.perf_counter() - start)
        return out

    comm.all_reduce_sum = timed
    step()
    waits.clear()
    with_sums = common.timed(step, warmup=0, steps=1)[0]
    comm.all_reduce_sum = lambda x, group=None: x  # wrong numbers, compute time only
    without = common.median(common.timed(step, warmup=1, steps=2))
    comm.all_reduce_sum = original
    waits.sort()
    return {"step_s": with_sums, "no_sums_step_s": without, "sums": len(waits), "in_sums_s": sum(waits),
            "median_ms": 1e3 * statistics.median(waits), "p90_ms": 1e3 * waits[9 * len(waits) // 10],
            "max_ms": 1e3 * waits[-1]}


def _pp_path(rank: int, world: int, rows: int, schedule: str = "afab") -> dict:
    """Forward and backward durations per microbatch, from one step's timeline."""
    stage, step, _ = pp._ours(rank, world, 4, schedule)
    step()
    start = time.time()
    step()
    wall = time.time() - start
    return {
        "wall_s": wall,
        "forward_s": [e.end - e.start for e in stage.timeline if e.kind == "forward"],
        "backward_s": [e.end - e.start for e in stage.timeline if e.kind == "backward"],
        "busy_s": sum(e.end - e.start for e in stage.timeline),  # every action, split backwards too
    }


def _print_top(results: list[dict]) -> None:
    for rank, summary in enumerate(results):
        print(f"rank {rank}: {summary['total_ms']:.0f} ms of self CPU time, {summary['gloo_ms']:.0f} ms in gloo")
        for key, ms, count in summary["top"]:
            print(f"  {ms:9.1f} ms  {count:6d}x  {key}")


def _print_path(results: list[dict], schedule: str) -> None:
    step = max(r["wall_s"] for r in results)
    for rank, r in enumerate(results):
        print(f"rank {rank}: step {r['wall_s']:.3f} s, busy {r['busy_s']:.3f} s ({r['busy_s'] / step:.3f} of the step)")
    if schedule in pp.VIRTUAL_STAGES:
        # No schedule runs a step faster than its busiest rank's compute.
        print(f"step / busiest rank's compute = {step / max(r['busy_s'] for r in results):.3f}")
        return
    first, last = results[0], results[-1]
    busy_last = sum(last["forward_s"]) + sum(last["backward_s"])
    # 2 stages, AFAB or 1F1B: stage 1 cannot start before stage 0's first forward, and
    # stage 0's last backward cannot start before stage 1's last backward. Under 1F1B
    # stage 1 never waits in between either while it is the slower stage: stage 0's
    # backward and next forward fit in stage 1's forward and backward.
    bound = first["forward_s"][0] + busy_last + first["backward_s"][-1]
    for rank, r in enumerate(results):
        print(f"rank {rank}: step {r['wall_s']:.3f} s, forward {sum(r['forward_s']):.3f} s, "
              f"backward {sum(r['backward_s']):.3f} s over {len(r['forward_s'])} microbatches")
    print(f"critical path (stage 0 first forward + stage 1 busy + stage 0 last backward): {bound:.3f} s; "
          f"step / bound = {step / bound:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["tp", "pp", "tp-sums", "pp-path"])
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--schedule", choices=list(pp.TORCH_SCHEDULES), default="afab", help="for pp and pp-path")
    args = parser.parse_args()
    fn = {"tp": _profile_tp, "pp": _profile_pp, "tp-sums": _tp_sums, "pp-path": _pp_path}[args.which]
    if args.which.startswith("pp"):
        fn = functools.partial(fn, schedule=args.schedule)
    results = common.launch(fn, 2, args.rows)
    if args.which in ("tp", "pp"):
        _print_top(results)
    elif args.which == "pp-path":
        _print_path(results, args.schedule)
    else:
        for rank, r in enumerate(results):
            print(f"rank {rank}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
