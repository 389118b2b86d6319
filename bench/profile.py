"""Where a step's time goes: torch.profiler summaries of our TP and PP steps.

    .venv/bin/python -m bench.profile tp          # top operators, TP=2
    .venv/bin/python -m bench.profile pp          # top operators, PP=2
    .venv/bin/python -m bench.profile tp-sums     # TP: time in the sums, and the step without them
    .venv/bin/python -m bench.profile pp-path     # PP: the critical path from the timeline
    .venv/bin/python -m bench.profile pp-path --schedule 1f1b   # the same under 1F1B (also: pp)
    .venv/bin/python -m bench.profile pp-path --schedule zbv    # virtual stages: busy time per rank
    .venv/bin/python -m bench.profile dp --sharding replicate  # DP=2: ours against torch DDP, op by op
    .venv/bin/python -m bench.profile dp --sharding full       # the same against FSDP2 by hand
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from bench import common, dp, pp, tp


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


_TORCH_DP = {"replicate": ("torch DDP", dp._ddp), "full": ("torch FSDP2", dp._fsdp2), "grad_op": ("torch FSDP2", dp._fsdp2)}


def _dp_ops(rank: int, world: int, rows: int, sharding: str = "replicate", steps: int = 6) -> dict:
    """Per operator, self CPU ms per step (mean of `steps` profiled steps) and calls, ours and torch's."""
    name, torch_side = _TORCH_DP[sharding]
    sides = {f"rewrite {sharding}": dp._ours(rank, sharding), name: torch_side(rank)}
    for module, step in sides.values():
        for _ in range(2):  # warm up
            step()
            module.zero_grad(set_to_none=True)
    out: dict[str, dict[str, list]] = {side: {} for side in sides}
    for i in range(steps):  # the sides take turns, every other step in reverse: drift hits both alike
        for side in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            module, step = sides[side]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
                module.zero_grad(set_to_none=True)
            for e in prof.key_averages():
                out[side].setdefault(e.key, [0.0, e.count])[0] += e.self_cpu_time_total / 1e3 / steps
    return out


def _print_dp(results: list[dict], rows: int) -> None:
    """The operators whose time differs most between the two sides, rank 0."""
    ours, theirs = results[0].values()
    names = list(results[0])
    print(f"self CPU ms per step, rank 0: {names[0]} {sum(v[0] for v in ours.values()):.0f}, "
          f"{names[1]} {sum(v[0] for v in theirs.values()):.0f}")
    print(f"  {'difference':>10}  {names[0]:>22}  {names[1]:>22}  operator")
    keys = sorted(set(ours) | set(theirs), key=lambda k: -abs(ours.get(k, [0])[0] - theirs.get(k, [0])[0]))
    for key in keys[:rows]:
        a, b = ours.get(key, [0.0, 0]), theirs.get(key, [0.0, 0])
        print(f"  {a[0] - b[0]:10.1f}  {a[0]:12.1f} ms {a[1]:5d}x  {b[0]:12.1f} ms {b[1]:5d}x  {key[:60]}")


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
    parser.add_argument("which", choices=["tp", "pp", "tp-sums", "pp-path", "dp"])
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--schedule", choices=list(pp.TORCH_SCHEDULES), default="afab", help="for pp and pp-path")
    parser.add_argument("--sharding", choices=list(_TORCH_DP), default="replicate", help="for dp")
    args = parser.parse_args()
    fn = {"tp": _profile_tp, "pp": _profile_pp, "tp-sums": _tp_sums, "pp-path": _pp_path, "dp": _dp_ops}[args.which]
    if args.which.startswith("pp"):
        fn = functools.partial(fn, schedule=args.schedule)
    if args.which == "dp":
        fn = functools.partial(fn, sharding=args.sharding)
    results = common.launch(fn, 2, args.rows)
    if args.which == "dp":
        _print_dp(results, args.rows)
    elif args.which in ("tp", "pp"):
        _print_top(results)
    elif args.which == "pp-path":
        _print_path(results, args.schedule)
    else:
        for rank, r in enumerate(results):
            print(f"rank {rank}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
