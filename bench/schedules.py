"""PP = 2, schedule by schedule: rewrite's run_schedule against torch.distributed.pipelining.

    .venv/bin/python -m bench.schedules            # about 3 minutes on 2 cores
    .venv/bin/python -m bench.schedules --steps 3  # a quick look
    .venv/bin/python -m bench.schedules --torch-only --schedules zbv,afab   # one side, a few schedules

Each schedule runs against its torch counterpart (`pp.TORCH_SCHEDULES`): afab against
`ScheduleGPipe` and 1f1b against `Schedule1F1B` on two stages (layers [0, 4) and [4, 8));
interleaved-1f1b, zero-bubble and zbv, with two stages per rank, against
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble` and `ScheduleZBVZeroBubble` on four
stages of two layers (`pp.layer_cuts`, placed by `pp.held_stages`). All pipelines share the
same two processes and take turns step by step. Per schedule: step time; memory per rank
measured two ways on both sides, the most bytes of saved activations alive at once
(`common.SavedTensors`) and the most bytes of tensor memory a step allocates and holds at once
(`common.allocation_peak`); and parity: the step's loss and gradient norm against the counterpart's.
Writes the "schedules" entry of bench/results.json (`bench.run` runs it too).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch.distributed as dist

from bench import common, pp
from bench.schedules_report import SIDES, summarize, table

SCHEDULES = tuple(pp.TORCH_SCHEDULES)  # afab, 1f1b, interleaved-1f1b, zero-bubble, zbv
PP = 2

__all__ = ["compare", "summarize", "table", "SCHEDULES", "PP"]


def compare(rank: int, world: int, warmup: int, steps: int, cut: int = 4,
            names: tuple[str, ...] = SCHEDULES, sides: tuple[str, ...] = SIDES) -> dict:
    """Times of every step of every pipeline, then one step each for parity and one for memory."""
    runs, kept = {}, {}
    for name in names:
        if "rewrite" in sides:
            stage, step, _ = pp._ours(rank, world, cut, name)
            runs[f"rewrite {name}"] = (stage.module, step)
        if "torch" in sides:
            module, step, torch_stages = pp._torch_pipeline(rank, world, cut, name)
            runs[f"torch {name}"] = (module, step)
            kept[f"torch {name}"] = torch_stages
    keys = list(runs)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for i in range(warmup + steps):
        # Alternate, so drift affects all alike; every other round in reverse, so none always goes first.
        for key in keys if i % 2 == 0 else keys[::-1]:
            t = common.timed(runs[key][1], warmup=0, steps=1)[0]
            if i >= warmup:
                times[key].append(t)
    parity = {}
    for key, (module, step) in runs.items():
        dist.barrier()
        loss = step(keep_grads=True)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        parity[key] = {
            "loss": None if loss is None else float(loss),
            "grad_sq": math.fsum(float(g.double().pow(2).sum()) for g in grads),  # this rank's share
        }
        module.zero_grad(set_to_none=True)
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
            "kept_between_steps_bytes": sum(_kept_bytes(s) for s in kept.get(key, [])),
        }
    return {"times": times, "parity": parity, "memory": memory}


def _kept_bytes(stage) -> int:
    """Receive buffers (and the input gradients on them) a torch PipelineStage keeps from step to step."""
    total = 0
    for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
        for info in infos:
            for t in (info.buffer, getattr(info.buffer, "grad", None)):
                if t is not None:
                    total += t.numel() * t.element_size()
    return total


def main() -> None:
    parser = common.step_parser(__doc__, steps=7, per="implementation")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + ", ".join(SCHEDULES))
    parser.add_argument("--torch-only", action="store_true", help="only torch's schedules (no rewrite side)")
    parser.add_argument("--out", default=None,
                        help="its 'schedules' entry is replaced; default bench/results.json for a full run, "
                             "nothing written for a partial one")
    args = parser.parse_args()
    names = tuple(n.strip() for n in args.schedules.split(",") if n.strip())
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: unknown {', '.join(unknown)}; choose from {', '.join(SCHEDULES)}")
    sides = ("torch",) if args.torch_only else SIDES
    full = set(names) == set(SCHEDULES) and sides == SIDES
    out = Path(args.out) if args.out else (Path("bench/results.json") if full else None)
    start = time.time()
    single = common.single_process(pp.one_process, args.warmup, args.steps)
    runs = common.launch(compare, PP, args.warmup, args.steps, 4, names, sides)
    res = summarize(runs, common.median(single["times"]), PP)
    res["one_process_times"] = single["times"]
    res["wall_s"] = time.time() - start
    if out is not None:
        common.save_result(out, "schedules", res)
    print(table(res))
    if out is None:
        print("(a partial run: nothing written; pass --out to keep it)")


if __name__ == "__main__":
    main()
