"""rewrite's steps against torch's own, each side alone in a pair of fresh processes, taking turns.

    .venv/bin/python -m bench.turns                          # about 12 minutes on 2 cores
    .venv/bin/python -m bench.turns --pairs replicate,zbv --rounds 1 --steps 3   # a quick look

`bench.run` alternates both sides step by step inside the same two processes, which share
the allocator, caches and threads; here every run is a fresh process pair running one side
only. Round r runs each pair's two sides one after the other (torch's first on odd rounds);
a run's time is the median of its steps (the slower rank's, after warm-up); a pair's figure is
the median over rounds of ours / torch's. The pairs: dp 2 `replicate` against DDP and `full`
against FSDP2 (`bench.dp`), in float32 and in the bfloat16 recipe (`full-bf16`: both sides under
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`), and afab, interleaved-1f1b and zbv against `ScheduleGPipe`,
`ScheduleInterleaved1F1B` and `ScheduleZBVZeroBubble` (`bench.pp`). Writes the "turns" entry of
bench/results.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import common, dp, pp

PAIRS = {  # name: (rewrite's side, torch's side)
    "replicate": ("rewrite replicate", "torch DDP"),
    "full": ("rewrite full", "torch FSDP2"),
    "full-bf16": ("rewrite full bf16", "torch FSDP2 bf16"),
    "afab": ("rewrite afab", "torch afab"),
    "interleaved-1f1b": ("rewrite interleaved-1f1b", "torch interleaved-1f1b"),
    "zbv": ("rewrite zbv", "torch zbv"),
}
WORLD = 2


def _build(rank: int, world: int, side: str):
    """(module, step) of one side; `step()` runs one training step, gradients left to clear."""
    if side == "rewrite replicate":
        return dp._ours(rank, "replicate")
    if side == "rewrite full":
        return dp._ours(rank, "full")
    if side == "torch DDP":
        return dp._ddp(rank)
    if side == "torch FSDP2":
        return dp._fsdp2(rank)
    if side == "rewrite full bf16":  # the bfloat16 recipe: FSDP2's MixedPrecisionPolicy under both
        return dp._ours(rank, "full", torch.bfloat16)
    if side == "torch FSDP2 bf16":
        return dp._fsdp2(rank, torch.bfloat16)
    who, schedule = side.split(" ", 1)
    if who == "rewrite":
        stage, step, _ = pp._ours(rank, world, 4, schedule)
        return stage.module, step
    module, step, _ = pp._torch_pipeline(rank, world, 4, schedule)
    return module, step


def side_times(rank: int, world: int, build, side: str, warmup: int, steps: int) -> list[float]:
    """Seconds per step of one side (`build(rank, world, side)` gives its module and step), run alone in these
    processes."""
    module, step = build(rank, world, side)
    times = []
    for i in range(warmup + steps):
        t = common.timed(step, warmup=0, steps=1)[0]
        module.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(t)
    return times


def measure(pairs: list[str], rounds: int, warmup: int, steps: int, *, sides: dict = PAIRS, build=_build) -> dict:
    """Each pair of `sides` (name -> (ours, theirs)) in turns, fresh processes a run (`build` makes a side)."""
    out = {name: {"ours_s": [], "torch_s": [], "ratios": []} for name in pairs}
    for r in range(rounds):
        for name in pairs:
            order = sides[name] if r % 2 == 0 else sides[name][::-1]
            median = {}
            for side in order:
                runs = common.launch(side_times, WORLD, build, side, warmup, steps)
                median[side] = statistics.median(max(step) for step in zip(*runs))  # the slower rank per step
            ours, theirs = (median[side] for side in sides[name])
            out[name]["ours_s"].append(ours)
            out[name]["torch_s"].append(theirs)
            out[name]["ratios"].append(ours / theirs)
            print(f"round {r + 1}: {name}: {ours:.3f} s / {theirs:.3f} s = {ours / theirs:.3f}", flush=True)
    for name in pairs:
        out[name]["ratio"] = statistics.median(out[name]["ratios"])
    return out


def table(res: dict, sides: dict = PAIRS, *, heads: tuple[str, str] = ("rewrite", "torch"), by_name: bool = False
          ) -> str:
    """Markdown rows of `measure`'s result: each pair (labelled by its sides, or `by_name`) with its two sides'
    seconds per round and their ratios."""
    lines = [f"| pair | {heads[0]}, median s per round | {heads[1]}, median s per round | ratio per round | "
             "median ratio |", "|---|---|---|---|---|"]
    for name, r in res.items():
        label = name if by_name else " / ".join(sides[name])
        lines.append(f"| {label} | {', '.join(f'{t:.3f}' for t in r['ours_s'])} | "
                     f"{', '.join(f'{t:.3f}' for t in r['torch_s'])} | {', '.join(f'{x:.2f}' for x in r['ratios'])} | "
                     f"{r['ratio']:.2f} |")
    return "\n".join(lines)


def turn_flags(description: str, sides: dict) -> argparse.ArgumentParser:
    """A bench's parser for pairs taken in turns: --pairs (of `sides`), --rounds, --steps, --warmup, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--pairs", default=",".join(sides), help=f"comma-separated, of {'; '.join(sides)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--out", default="bench/results.json")
    return parser


def chosen_pairs(parser: argparse.ArgumentParser, args: argparse.Namespace, sides: dict) -> list[str]:
    """The pairs --pairs names, each one of `sides` (else the parser's error)."""
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in sides]
    if unknown:
        parser.error(f"unknown pair(s) {', '.join(unknown)}; choose from {'; '.join(sides)}")
    return pairs


def main() -> None:
    parser = turn_flags(__doc__.splitlines()[0], PAIRS)
    args = parser.parse_args()
    res = measure(chosen_pairs(parser, args, PAIRS), args.rounds, args.warmup, args.steps)
    print(table(res))
    common.save_result(args.out, "turns", {"rounds": args.rounds, "steps": args.steps, "pairs": res})


if __name__ == "__main__":
    main()
