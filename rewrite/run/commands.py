"""What the `rewrite` commands show, validate, schema, train, export and init-model do once their flags are
parsed (`cli` parses them; `plan` and `calibrate` are `plan_cmd`'s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["shown_dtype", "cmd_show", "cmd_validate", "cmd_schema", "cmd_train", "cmd_export", "cmd_init_model"]


def shown_dtype(hardware: str | None) -> str:
    """`show`'s and `plan`'s default `--dtype`: the profile's (`estimate.hardware.default_dtype`:
    bfloat16 on a GPU), float32 without one, as `rewrite train` takes bfloat16 on a GPU."""
    from ..estimate.hardware import default_dtype, load_hardware

    return "float32" if hardware is None else default_dtype(load_hardware(hardware))


def _meta_model(model: str, dtype: str | None = None):
    """The model with no weights allocated: enough to bind a plan to it."""
    import torch

    from .presets import build_model, load_config

    config = load_config(model)
    return build_model(config, device="meta", dtype=getattr(torch, dtype) if dtype else None)


def cmd_show(args: argparse.Namespace) -> int:
    from ..estimate.hardware import load_hardware
    from ..estimate.balance import balance_warnings
    from ..binding.resolve import resolve
    from .show.columns import wrap_prose
    from .show.data import show_data
    from .show.options import format_options
    from .show.report import render_text
    from .show.schedule import format_schedule

    model = _meta_model(args.model, "float32")  # the master weights `rewrite train` holds, whatever the config says
    resolved = resolve(args.plan, model, world_size=args.world_size)
    _check_context_parallel(resolved, model, args.model)
    dtype = args.dtype or shown_dtype(args.hardware)  # one compute dtype for every table
    limit, source = args.memory_limit, None
    if limit is None and args.hardware:  # the ranks marked against what the device leaves to tensors
        profile = load_hardware(args.hardware)
        limit, source = profile.usable_gib(), profile.usable_text()
    data = show_data(resolved, model, model_label=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                     microbatches=args.microbatches, memory_limit=limit, limit_source=source,
                     warnings=[*resolved.warnings, *balance_warnings(resolved, model)],
                     hardware=args.hardware, gpus_per_node=args.gpus_per_node, dtype=dtype)
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return 0
    print(render_text(data))
    options = format_options(resolved, model, batch_size=args.batch_size, seq_len=args.seq_len,
                             microbatches=args.microbatches, dtype=dtype)
    if options:
        print()
        print(wrap_prose(options))
    if args.schedule:
        print()
        print(format_schedule(resolved.plan, microbatches=args.microbatches))
    return 0


def _mesh_words(plan) -> str:
    """`dp=2 x pp=2 x tp=2 = 8 ranks, 2 replicas with data_parallel.sharding full` (replicas only when dp > 1)."""
    from ..plan.wording import plural

    mesh = plan.mesh
    words = f"{mesh.shape_text()} = {plural(mesh.world_size, 'rank')}"
    return words + (f", {mesh.dp} replicas with data_parallel.sharding {plan.data_parallel.sharding}" if mesh.dp > 1 else "")


def cmd_validate(args: argparse.Namespace) -> int:
    from ..plan.loading import load_plan
    from ..binding.resolve import resolve

    if args.model is None:
        plan = load_plan(args.plan)
        if args.world_size is not None and args.world_size != plan.mesh.world_size:
            from ..plan.schema import PlanError
            from ..plan.size_checks import world_problem

            raise PlanError(args.plan, [world_problem(plan, args.world_size)])
        print(f"{args.plan}: OK as a plan (mesh {_mesh_words(plan)}); pass --model to check it against a model too")
        return 0
    from ..estimate.balance import balance_warnings
    from ..plan.wording import plural

    model = _meta_model(args.model)
    resolved = resolve(args.plan, model, world_size=args.world_size)  # the file's problems and the model's at once
    _check_context_parallel(resolved, model, args.model)
    plan, r, n = resolved.plan, resolved.kv_replicas, len(resolved.stages)
    kv = f" (kv heads replicated {r}x: each of the {plan.mesh.tp // r} on {r} tp ranks)" if r > 1 else ""
    print(
        f"{args.plan}: OK for {resolved.model_name} ({args.model}): {_mesh_words(plan)}, "
        f"{len(resolved.shards)} sharded modules{kv}, {plural(n, 'stage')}"
    )
    for warning in [*resolved.warnings, *balance_warnings(resolved, model)]:  # valid, but worth a look
        print(f"warning: {args.plan}: {warning}", file=sys.stderr)
    return 0


def _check_context_parallel(resolved, model, name: str) -> None:
    """Refuse mesh.cp > 1 for a family whose attention context parallelism cannot run (as apply_plan does)."""
    from ..context_parallel.family import context_parallel_problem
    from ..plan.schema import PlanError

    cp = resolved.plan.mesh.cp
    if cp > 1 and (problem := context_parallel_problem(model)):
        raise PlanError(resolved.plan.source, [
            f"{resolved.plan.where('mesh', 'cp')}mesh.cp={cp}: {resolved.model_name} ({name}): {problem}; use cp 1"])


def cmd_schema(args: argparse.Namespace) -> int:
    from ..plan.schema import ParallelPlan

    sys.stdout.write(json.dumps(ParallelPlan.model_json_schema(), indent=2) + "\n")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .train_entry import train_main
    from .train_flags import train_config
    from .train_launch import launch_train, split_launch_args

    if args.nproc_per_node is not None:  # this process launches the workers, each runs the rest of the command
        if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
            print("error: --nproc-per-node under torchrun (or a launcher of its kind): this process is a worker "
                  "already; use one launcher, `rewrite train ... --nproc-per-node N` or torchrun", file=sys.stderr)
            return 2
        launch, rest = split_launch_args(args.command_line[1:])
        return launch_train(launch, rest)
    train_main(train_config(args))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..checkpoint.export import checkpoint_path, export_checkpoint
    from ..checkpoint.state_dirs import STEP_DIR

    source = checkpoint_path(args.checkpoint, args.step)
    out = export_checkpoint(source, args.out, adapter_only=args.adapter_only, base=args.merge)
    step = STEP_DIR.match(source.name)
    which = f"step {int(step[1])} ({source})" if step else str(source)
    loads = (f"peft.PeftModel.from_pretrained(base, {str(out)!r})" if args.adapter_only
             else f"AutoModelForCausalLM.from_pretrained({str(out)!r})")
    print(f"wrote {out} from {which}: loads with {loads}")
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from .tiny_model import make_tiny_checkpoint

    out = make_tiny_checkpoint(args.out, preset=args.preset, data=args.data, vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote {out}: a {args.preset} model with random weights and a BPE tokenizer trained on its text")
    return 0
