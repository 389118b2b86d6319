"""`rewrite plan` (the fastest plan that fits, `rewrite.estimate.search`) and `rewrite calibrate`
(this machine as a hardware profile), and the `--hardware` flags `show` shares with them."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

from .flag_words import in_flags
from .plan_measure import add_measure_flags

__all__ = ["add_hardware_flags", "add_plan_parser", "add_calibrate_parser", "plan_file_text", "BAD_ARGUMENTS"]

BAD_ARGUMENTS = 2  # argparse's own status for a usage error


def add_hardware_flags(parser: argparse.ArgumentParser, help: str, default: str | None = None) -> None:
    from ..estimate.hardware import HARDWARE_NAMES

    parser.add_argument("--hardware", default=default, metavar="NAME|FILE",
                        help=f"{help} ({', '.join(HARDWARE_NAMES)}) or a profile file from `rewrite calibrate`"
                        + (" (default %(default)s)" if default else ""))
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                        help="devices per node (default: the profile's); tensor parallelism stays within one")


def add_plan_parser(sub) -> None:
    from .train_flags import MODEL_HELP
    from .train_setup import DTYPES

    plan = sub.add_parser("plan", help="the fastest plan that fits: a model, the devices and their memory in, a plan file out")
    plan.add_argument("--model", required=True, metavar="MODEL", help=MODEL_HELP)
    plan.add_argument("--world", required=True, type=int, metavar="N", help="devices (ranks) to plan for")
    plan.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                      help="memory per device in GiB (default: the hardware profile's)")
    add_hardware_flags(plan, "the devices: a profile name", default="h100-sxm")
    plan.add_argument("--seq-len", type=int, default=2048, metavar="TOKENS", help="tokens per sequence (default %(default)s)")
    plan.add_argument("--global-batch", type=int, default=None, metavar="SEQUENCES",
                      help="sequences per step over all replicas (default: 4 per device)")
    plan.add_argument("--dtype", choices=DTYPES, default=None,
                      help="compute dtype over float32 weights, gradients and AdamW state, as `rewrite train --dtype` "
                      "runs it (default: bfloat16 on a profile whose bfloat16 peak passes its float32 one, a GPU's; "
                      "else float32)")
    plan.add_argument("--lora-rank", type=int, default=None, metavar="R",
                      help="plan LoRA training: adapters of rank R on every layer's projections, every other weight "
                      "frozen (gradients and AdamW state for the adapters only; docs/lora.md)")
    plan.add_argument("--lora-alpha", type=float, default=None, metavar="ALPHA",
                      help="with --lora-rank: the adapters' alpha (written into the plan; default: R)")
    plan.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                      help="plan every candidate compiled (`compile: true`) or none (default: each both ways where "
                      "the profile holds compiled terms `rewrite calibrate` measured, the faster kept; else eager)")
    plan.add_argument("--top", type=int, default=10, metavar="K", help="rows of the table printed (default %(default)s)")
    plan.add_argument("--out", default=None, metavar="FILE",
                      help="write the best plan here (default: ./plan.yaml, or the next free plan-N.yaml; when stdout "
                      "is not a terminal, the plan alone is printed there and the table goes to stderr)")
    plan.add_argument("--json", action="store_true", help='print {"candidates": [...]} ranked by step_s instead of tables')
    add_measure_flags(plan)
    plan.set_defaults(func=_cmd_plan)


def add_calibrate_parser(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine (matmuls, memory, links between local ranks) into a hardware profile")
    cal.add_argument("--world", type=int, default=2, metavar="N", help="local ranks measured together (default %(default)s)")
    cal.add_argument("--out", default=None, metavar="FILE", help="write the profile here (default: print it)")
    cal.add_argument("--name", default="calibrated", help="the profile's name (default %(default)s)")
    cal.add_argument("--repeats", type=int, default=10, metavar="N",
                     help="timings of each measurement (default %(default)s; fewer: quicker and noisier)")
    cal.add_argument("--compile", default=True, action=argparse.BooleanOptionalAction,
                     help="measure a compiled layer too, what `rewrite plan` weighs `compile` by (default: on; the "
                     "first compile takes about half a minute, cached for the next)")
    cal.add_argument("--model", default=None, metavar="NAME|PATH",
                     help="fit the layer terms on this model's decoder layers (a preset, a config.json or model "
                     "directory, at sizes this machine runs): its family's operators beyond the matmuls, as they run "
                     "(default: the bench LLaMA's)")
    cal.set_defaults(func=_cmd_calibrate)


def _lora_section(args: argparse.Namespace) -> dict | None:
    """The plans' `lora` section that --lora-rank / --lora-alpha ask for (None: full training)."""
    from ..plan.schema import Lora

    if args.lora_rank is None:
        if args.lora_alpha is not None:
            raise ValueError("--lora-alpha needs --lora-rank R")
        return None
    try:
        return Lora(rank=args.lora_rank, alpha=args.lora_alpha).model_dump(exclude_none=True, exclude_defaults=True) | {
            "rank": args.lora_rank}
    except ValueError as exc:
        first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": ("rank",), "msg": str(exc)}
        raise ValueError(f"--lora-{first['loc'][0]}: {first['msg']}") from None


def _fail(message: str, status: int) -> int:
    print(f"error: {in_flags(message)}", file=sys.stderr)
    return status


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..estimate.hardware import load_hardware
    from ..estimate.search import NoPlanFits, check_arguments, suggest_plans
    from .launch import LaunchError
    from .plan_measure import measure_problem, measure_top, measured_table, write_profile
    from .presets import load_config

    try:
        if args.top < 1:
            raise ValueError(f"--top is {args.top}; use a whole number >= 1")
        hardware = load_hardware(args.hardware)
        config = load_config(args.model)
        kwargs = dict(world=args.world, device_memory=args.device_memory, gpus_per_node=args.gpus_per_node,
                      seq_len=args.seq_len, global_batch=args.global_batch)
        check_arguments(**kwargs)
        problem = measure_problem(args, hardware)
        if problem:
            raise ValueError(problem)
        lora = _lora_section(args)
    except ValueError as exc:  # a bad argument: one line, no traceback
        return _fail(str(exc), BAD_ARGUMENTS)
    model, max_cp = _planned_model(config)
    try:
        found = suggest_plans(model, hardware=hardware, dtype=args.dtype, max_cp=max_cp, lora=lora,
                              compiled=args.compile, **kwargs)
    except NoPlanFits as exc:
        return _fail(str(exc), 1)
    except ValueError as exc:  # a device memory within the profile's reserve
        return _fail(str(exc), BAD_ARGUMENTS)
    try:
        measured = measure_top(found, args, hardware, model) if args.measure else None
    except LaunchError as exc:
        return _fail(f"--measure: {exc}", 1)
    wrote = write_profile(measured, args, hardware) if measured and args.profile else None
    best = measured.candidates[measured.fastest] if measured else found[0]
    timed = measured.timed[measured.fastest].median_s if measured else None
    if args.json:
        if args.out:
            Path(args.out).write_text(plan_file_text(best, args, hardware, name=args.out, measured_s=timed))
        data = {"candidates": [c.as_dict() for c in found]}
        if measured:
            data["measured"] = measured.as_dict()
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        if wrote:
            print(wrote, file=sys.stderr)
        return 0
    table = format_candidates(found[: args.top], hardware=hardware, total=len(found), args=args)
    if measured:
        table += "\n\n" + measured_table(measured, args) + (f"\n{wrote}" if wrote else "")
    if not args.out and not sys.stdout.isatty():  # `rewrite plan ... > mine.yaml`: the plan alone on stdout
        print(table, file=sys.stderr)
        sys.stdout.write(plan_file_text(best, args, hardware, name=_stdout_file() or "PLAN.yaml", measured_s=timed))
        return 0
    out = args.out or _free_name()
    Path(out).write_text(plan_file_text(best, args, hardware, name=out, measured_s=timed))
    print(table)
    print()
    print(f"wrote {out}" if args.out else f"wrote {out} (--out FILE names another)")
    return 0


def _free_name() -> str:
    """plan.yaml, or plan-2.yaml, plan-3.yaml, ... where it exists: never over a file already there."""
    n = 1
    while Path(name := "plan.yaml" if n == 1 else f"plan-{n}.yaml").exists():
        n += 1
    return name


def _stdout_file() -> str | None:
    """The file stdout is redirected into (relative to here when below it), None for a pipe or elsewhere."""
    try:
        if not stat.S_ISREG(os.fstat(sys.stdout.fileno()).st_mode):
            return None
        target = Path(os.readlink("/proc/self/fd/1"))  # Linux; elsewhere the name stays a placeholder
    except (OSError, ValueError, AttributeError):
        return None
    return os.path.relpath(target) if target.is_relative_to(Path.cwd()) else str(target)


def format_candidates(found, *, hardware, total: int, args: argparse.Namespace) -> str:
    """The top candidates as a table: mesh, schedule, microbatches, sharding, switches, time, memory; `hardware`: the
    profile they were planned on (a `Hardware`)."""
    from .show.columns import format_bytes, format_table

    rows = []
    for i, c in enumerate(found, 1):
        plan, pipe = c.plan, c.plan.pipeline
        switches = " + ".join(n for on, n in ((plan.sequence_parallel, "sp"), (plan.loss_parallel, "vocab/loss"),
                                             (plan.compile is not None, "compile")) if on)
        rows.append([
            str(i), plan.mesh.shape_text(), pipe.schedule + (f" x{pipe.virtual_stages}" if pipe.virtual_stages > 1 else ""),
            f"{pipe.microbatches} x {c.batch_size}", _dp_text(plan),
            switches or "-", c.checkpointing, f"{c.step_s:.3g}", f"{c.tokens_per_s:,.0f}", f"{c.mfu:.0%}",
            format_bytes(c.peak_bytes),
        ])
    head = (f"Plans for {args.model} on {args.world} x {hardware.name}, {total} fitting in "
            f"{hardware.usable_text(args.device_memory).replace(f' on {hardware.name}', '')}; fastest first "
            "(predicted by rewrite.estimate.step_time, memory by rewrite.estimate.memory)")
    return "\n".join([head, format_table(
        ["#", "mesh", "schedule", "microbatches x seqs", "sharding, reduce", "switches", "checkpointing", "step s",
         "tokens/s/device", "MFU", "busiest rank"], rows)])


def _planned_model(config):
    """The model a search plans (meta, float32 master weights) and the most cp ranks it may use: 1, said on
    stderr, where the family's attention does not run under context parallelism."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..context_parallel.family import context_parallel_problem

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    problem = context_parallel_problem(model)
    if problem:
        print(f"note: plans without context parallelism (cp 1): {problem}", file=sys.stderr)
    return model, 1 if problem else None


def _dp_text(plan) -> str:
    """'full, per step' or 'grad_op, per microbatch' (`data_parallel`); '-' where no ranks share the parameters
    (no replicas, no cp ranks)."""
    dpp = plan.data_parallel
    return f"{dpp.sharding}, per {dpp.reduce}" if plan.mesh.dp * plan.mesh.cp > 1 else "-"


def plan_file_text(best, args: argparse.Namespace, profile, *, name: str, measured_s: float | None = None) -> str:
    """The best candidate as a commented plan file `name`: what it predicts on `profile` (a `Hardware`), what a
    step measured (`measured_s`, by `--measure`), and the commands that run and show it, both with the compute
    dtype the search counted (`best.dtype`), so that they run and print what was planned."""
    plan, pipe, hardware = best.plan, best.plan.pipeline, profile.name
    world = plan.mesh.world_size
    dtype = f" --dtype {best.dtype}"
    described = plan.model_copy(update={"description": f"planned by rewrite plan for {args.model} on {world} x {hardware}"})
    return "\n".join([
        f"# Planned by `rewrite plan --model {args.model} --world {world} --seq-len {pipe.seq_len}"
        f"{' --device-memory ' + format(args.device_memory, 'g') if args.device_memory else ''} --hardware {hardware}"
        f"{dtype}`:",
        f"# {best.summary()}.",
        f"# Predicted on {hardware}: a step of {best.step_s:.3g} s ({plan.mesh.dp * pipe.microbatches * best.batch_size} "
        f"sequences of {pipe.seq_len} tokens), {best.tokens_per_s:,.0f} tokens/s per device, MFU {best.mfu:.0%}, "
        f"bubble {best.bubble:.0%};",
        *([f"# measured here by --measure {args.measure}: {measured_s:.3g} s a step on {world} local ranks, the fastest "
           "of the plans timed;"] if measured_s is not None else []),
        f"# the busiest rank holds {best.peak_bytes / 1024**3:.2f} GiB at its peak (weights, gradients, AdamW, activations;"
        f" float32 weights computed in {best.dtype}), within {profile.usable_text(args.device_memory)}.",
        f"#   rewrite show {name} --model {args.model} --batch-size {best.batch_size}{dtype} --hardware {hardware}",
        f"#   torchrun --nproc-per-node {world} -m rewrite train {name} --model {args.model} "
        f"--batch-size {best.batch_size} --seq-len {pipe.seq_len}{dtype}",
        described.to_yaml(),
    ])


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate, profile_yaml

    if args.world < 2:
        return _fail(f"--world {args.world}: calibrating the links needs at least 2 local ranks", BAD_ARGUMENTS)
    if args.repeats < 1:
        return _fail(f"--repeats {args.repeats}: each measurement needs at least 1 timing", BAD_ARGUMENTS)
    try:
        found = calibrate(args.world, repeats=args.repeats, compiled=args.compile, model=args.model)
    except ValueError as exc:
        return _fail(str(exc), BAD_ARGUMENTS)
    text = profile_yaml(found, name=args.name)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: use it as --hardware {args.out}")
    else:
        print(text.rstrip())
    return 0
