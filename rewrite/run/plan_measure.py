"""`rewrite plan --measure K`: the top K plans timed on this machine, the fastest measured picked, and the
profile corrected by what was measured (`--profile FILE`) for the next `plan` here."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["add_measure_flags", "measure_problem", "Measured", "measure_top", "other_sides"]


def add_measure_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--measure", type=int, default=None, metavar="K",
                        help="time the top K plans here (--world local ranks: this machine's GPUs, or its CPU cores) for "
                        "a few steps each, print predicted against measured, and keep the fastest measured")
    parser.add_argument("--measure-steps", type=int, default=3, metavar="N",
                        help="with --measure: steps timed per plan, after one warm-up step (default %(default)s)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="with --measure: write the --hardware profile corrected by the measured steps here, to "
                        "plan with next time on this machine (--hardware FILE)")


def measure_problem(args: argparse.Namespace, hardware) -> str | None:
    """Why `--measure` (and its flags) cannot run as given here, or None; checked before the search."""
    import torch

    from ..estimate.hardware import default_dtype

    if args.measure is None:
        return "--profile writes a profile corrected by measured steps: add --measure K" if args.profile else None
    if args.measure < 1:
        return f"--measure {args.measure}: give the number of plans to time, a whole number >= 1"
    if args.measure_steps < 1:
        return f"--measure-steps {args.measure_steps}: time at least 1 step per plan"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = "GPUs" if gpus else "CPU"
    profiled = "GPUs" if default_dtype(hardware) == "bfloat16" else "CPU"
    if here != profiled:
        return (f"--measure times the plans on this machine's {here}, but --hardware {hardware.name} describes {profiled}: "
                "the predictions and the measured steps would not compare; plan with this machine's profile "
                "(`rewrite calibrate --out here.yaml`, then --hardware here.yaml), or measure on the machine the job runs on")
    if gpus and args.world > gpus:
        return (f"--measure runs the plans on this machine: --world {args.world} needs {args.world} GPUs, {gpus} visible "
                "(timing a plan over several machines is not built)")
    return None


@dataclass(frozen=True)
class Measured:
    """What `--measure` found: the candidates timed (the planner's order), their times, the fastest, the fit."""

    candidates: list
    timed: list  # `measure.Timed`, one per candidate
    parts: list  # `correction.Parts`, one per candidate
    scales: object  # `correction.Scales`
    profile: object  # the corrected `Hardware`
    planned: int = 0  # how many of `candidates` are the planner's (the rest: the same plans the other way); 0: all

    @property
    def top(self) -> int:
        """The planner's candidates timed, first in `candidates`."""
        return self.planned or len(self.candidates)

    @property
    def fastest(self) -> int:
        return min(range(len(self.timed)), key=lambda i: self.timed[i].median_s)

    def as_dict(self) -> dict:
        """`{"plans": [...], "fastest", "scales"}`: each plan timed (its rank in `candidates`, from 0; a plan timed
        the other way too: `"other_side_of"` its rank) with its predicted, measured (median and each step) and
        corrected seconds, and its peak on a GPU."""
        s = self.scales
        return {
            "plans": [{"index": i, "summary": c.summary(), "predicted_s": c.step_s, "measured_s": t.median_s,
                       "steps_s": list(t.steps_s), "corrected_s": s.corrected(p), "measured_peak_bytes": t.peak_bytes,
                       **({"other_side_of": i - self.top} if i >= self.top else {})}
                      for i, (c, t, p) in enumerate(zip(self.candidates, self.timed, self.parts))],
            "fastest": self.fastest, "scales": {"compute": s.compute, "communication": s.communication, "how": s.how},
        }


def measure_top(found: list, args: argparse.Namespace, hardware, model) -> Measured:
    """Time the first `args.measure` of `found` (predicted fastest first) on `args.world` local ranks, with a
    progress bar on stderr, and fit the profile's correction to them."""
    from ..binding.resolve import resolve
    from ..estimate.correction import fit_scales, prediction_parts, scaled_profile
    from .measure import Job, time_plans

    chosen = found[: args.measure]
    # Where the search weighed compiling (the profile's compiled terms, neither --compile nor --no-compile), each
    # plan is timed the other way too: the faster side is then measured, not predicted.
    both = getattr(args, "compile", None) is None and hardware.compiled is not None
    chosen = chosen + (other_sides(chosen, model, hardware, args) if both else [])
    steps = 1 + args.measure_steps
    guess = sum(c.step_s for c in chosen) * steps
    cores = os.cpu_count() or 1
    where = "CPU" if _cpu_here() else "GPU"
    top = len(chosen) // 2 if both else len(chosen)
    print(f"measuring the top {top} plan{'s' * (top > 1)}{', compiled and eager,' if both else ''} on {args.world} "
          f"local ranks ({where}), "
          f"1 warm-up + {args.measure_steps} step{'s' * (args.measure_steps > 1)} each: about {guess:.3g} s by their "
          f"predicted steps on {hardware.name}, and the time to start the ranks and build each plan", file=sys.stderr)
    compiled = sum(c.plan.compile is not None for c in chosen)
    if compiled:
        from ..compiled import use_compile_cache

        kept = use_compile_cache()  # the ranks inherit it: kernels compiled once serve later runs
        print(f"note: {compiled} of them compile their blocks in their warm-up step (up to a minute each on a CPU the "
              f"first time; kept in {kept})", file=sys.stderr)
    if where == "CPU" and args.world > cores:
        print(f"note: {args.world} ranks share {cores} cores here, as a run of them would", file=sys.stderr)
    jobs = [Job(c.plan.model_dump(mode="json", exclude_none=True), c.batch_size, c.dtype) for c in chosen]
    with _Bar(len(jobs), steps) as bar:
        timed = time_plans(args.model, jobs, world=args.world, seq_len=args.seq_len, steps=args.measure_steps,
                           timeout_s=max(900.0, 20 * guess), progress=bar.update)
    G = args.gpus_per_node or hardware.devices_per_node
    parts = [prediction_parts(resolve(c.plan, model), model, hardware, batch_size=c.batch_size, dtype=c.dtype,
                              gpus_per_node=G) for c in chosen]
    scales = fit_scales(parts, [t.median_s for t in timed])
    links = ("intra_node",) if args.world <= G else ("intra_node", "inter_node")
    return Measured(chosen, timed, parts, scales, scaled_profile(hardware, scales, links=links),
                    planned=top if both else 0)


def other_sides(chosen: list, model, hardware, args: argparse.Namespace) -> list:
    """Each candidate with `compile` switched (on where it was off, off where it was on), predicted on `hardware`;
    its memory is the candidate's (compiling moves nothing the estimate counts)."""
    import dataclasses

    from ..binding.resolve import resolve
    from ..estimate.step_time import predict_step
    from ..plan.schema import Compile

    G = args.gpus_per_node or hardware.devices_per_node
    out = []
    for c in chosen:
        plan = c.plan.model_copy(update={"compile": None if c.plan.compile is not None else Compile()})
        got = predict_step(resolve(plan, model), model, hardware, batch_size=c.batch_size, dtype=c.dtype,
                           gpus_per_node=G)
        out.append(dataclasses.replace(c, plan=plan, step_s=got.step_s, tokens_per_s=got.tokens_per_s, mfu=got.mfu,
                                       bubble=got.bubble))
    return out


def _cpu_here() -> bool:
    import torch

    return not torch.cuda.is_available()


class _Bar:
    """tqdm on a terminal's stderr; otherwise a line per plan timed."""

    def __init__(self, plans: int, steps: int):
        self.total, self.steps, self.bar = plans * steps, steps, None

    def __enter__(self):
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="measure", unit="step", file=sys.stderr, dynamic_ncols=True)
        return self

    def update(self, done: int, total: int, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(done - self.bar.n)
        elif done % self.steps == 0:  # a plan's last step
            print(f"timed {text}", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def measured_table(found: Measured, args: argparse.Namespace) -> str:
    """The plans timed: the planner's rank, the plan, predicted, measured (median and range), their ratio and
    the prediction of the corrected profile; then which was fastest, and the correction."""
    import statistics

    from .show.columns import format_table

    rows, top = [], found.top
    for i, (c, t, p) in enumerate(zip(found.candidates, found.timed, found.parts), 1):
        mark = " (fastest measured)" if i - 1 == found.fastest else ""
        rank = str(i) if i <= top else f"{i - top}'"  # plan N the other way: compiled or eager
        rows.append([rank, c.summary() + mark, f"{c.step_s:.3g}", f"{t.median_s:.3g} ({min(t.steps_s):.3g}-"
                     f"{max(t.steps_s):.3g})", f"{t.median_s / c.step_s:.2f}", f"{found.scales.corrected(p):.3g}"])
    best, first = found.timed[found.fastest].median_s, found.timed[0].median_s
    errors = [abs(t.median_s / found.scales.corrected(p) - 1) for t, p in zip(found.timed, found.parts)]
    s = found.scales
    lines = [
        f"Measured here ({args.world} local ranks, median of {args.measure_steps} step"
        f"{'s' * (args.measure_steps > 1)} after a warm-up; a step is its slowest rank's)",
        format_table(["#", "plan", "predicted s", "measured s (range)", "measured / predicted", "corrected s"], rows),
        *([f"N': plan N the other way (compiled where it was eager, eager where compiled): compiled faster, measured, "
           f"for {_compiled_wins(found, top)} of {top}"] if top < len(found.candidates) else []),
        "",
        f"fastest measured: #{rows[found.fastest][0]}" + (
            " (the planner's top pick)" if found.fastest == 0 else
            f" ({best:.3g} s a step; the planner's top pick took {first:.3g} s, {first / best:.2f}x)"),
        f"correction: compute x{s.compute:.3g}, communication x{s.communication:.3g} ({s.how}); the corrected "
        f"predictions are within {statistics.median(errors):.0%} of the measured steps at the median, "
        f"{max(errors):.0%} at worst",
    ]
    return "\n".join(lines)


def _compiled_wins(found: Measured, top: int) -> int:
    """Of the `top` plans measured both ways, how many ran faster compiled."""
    times = [t.median_s for t in found.timed]
    compiled = [c.plan.compile is not None for c in found.candidates]
    return sum((times[j] < times[top + j]) == compiled[j] for j in range(top))


def write_profile(found: Measured, args: argparse.Namespace, hardware) -> str:
    """Write the corrected profile to `args.profile`; the line that says so."""
    from ..estimate.correction import profile_text

    header = [
        f"{found.profile.name}: {hardware.name} corrected by `rewrite plan --model {args.model} --world {args.world} "
        f"--measure {args.measure}` ({len(found.timed)} plans timed on this machine).",
        f"Compute terms x{found.scales.compute:.4g} (matmul rate, memory and activation bandwidth, fixed costs per layer "
        f"and microbatch), links used x{found.scales.communication:.4g} (latency and bandwidth): {found.scales.how}.",
        "Measured (median s) against predicted before the correction:",
        *[f"  {c.summary()}: {t.median_s:.4g} against {c.step_s:.4g}" for c, t in zip(found.candidates, found.timed)],
    ]
    Path(args.profile).write_text(profile_text(found.profile, header))
    return f"wrote {args.profile}: plan with it next time here (--hardware {args.profile})"
