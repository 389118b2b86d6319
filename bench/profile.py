"""Where a step's time goes: torch.profiler summaries of our TP and PP steps.

    .venv/bin/python -m bench.profile tp     # rank 0 of TP=2
    .venv/bin/python -m bench.profile pp     # both ranks of PP=2

Prints the top operators by self CPU time, and the share spent in gloo.
"""

from __future__ import annotations

import argparse

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


def _profile_pp(rank: int, world: int, rows: int) -> dict:
    _, step, _ = pp._ours(rank, world, 4)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return _summary(prof, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["tp", "pp"])
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    fn = _profile_tp if args.which == "tp" else _profile_pp
    for rank, summary in enumerate(common.launch(fn, 2, args.rows)):
        print(f"rank {rank}: {summary['total_ms']:.0f} ms of self CPU time, {summary['gloo_ms']:.0f} ms in gloo")
        for key, ms, count in summary["top"]:
            print(f"  {ms:9.1f} ms  {count:6d}x  {key}")


if __name__ == "__main__":
    main()
