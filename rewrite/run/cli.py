"""The `rewrite` command: show, validate, schema, train.

    rewrite show plans/llama-tp2-pp2.yaml --model tiny-llama
    rewrite validate plans/llama-tp2-pp2.yaml --model path/to/config.json
    rewrite schema > plans/plan.schema.json
    torchrun --nproc-per-node 4 -m rewrite train plans/llama-tp2-pp2.yaml --model tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

_MODEL_HELP = "an HF config.json, a local model directory, or a preset: {presets}"
_DTYPES = ("float32", "bfloat16", "float16")


def _meta_model(model: str, dtype: str | None = None):
    """The model with no weights allocated: enough to bind a plan to it."""
    import torch

    from .presets import build_model, load_config

    config = load_config(model)
    return build_model(config, device="meta", dtype=getattr(torch, dtype) if dtype else None)


def _cmd_show(args: argparse.Namespace) -> int:
    from ..plan.options_report import format_options
    from ..plan.report import format_plan, format_schedule
    from ..plan.resolve import resolve

    model = _meta_model(args.model, args.dtype)
    resolved = resolve(args.plan, model, world_size=args.world_size)
    print(format_plan(resolved, model_label=args.model, model=model))
    options = format_options(resolved, model)
    if options:
        print()
        print(options)
    if args.schedule:
        print()
        print(format_schedule(resolved.plan))
    return 0


def _mesh_words(plan) -> str:
    """`dp=2 x pp=2 x tp=2 = 8 ranks, 2 replicas with data_parallel.sharding full` (replicas only when dp > 1)."""
    mesh = plan.mesh
    words = f"{mesh.shape_text()} = {mesh.world_size} rank{'s' if mesh.world_size != 1 else ''}"
    return words + (f", {mesh.dp} replicas with data_parallel.sharding {plan.data_parallel.sharding}" if mesh.dp > 1 else "")


def _cmd_validate(args: argparse.Namespace) -> int:
    from ..plan.schema import load_plan
    from ..plan.resolve import resolve

    plan = load_plan(args.plan)
    if args.model is None:
        if args.world_size is not None and args.world_size != plan.mesh.world_size:
            from ..plan.schema import PlanError

            raise PlanError(args.plan, [
                f"mesh: {plan.mesh.shape_text()} = {plan.mesh.world_size} ranks, but the world size is "
                f"{args.world_size}; launch {plan.mesh.world_size} processes or change the mesh"
            ])
        print(f"{args.plan}: OK as a plan (mesh {_mesh_words(plan)}); pass --model to check it against a model too")
        return 0
    resolved = resolve(plan, _meta_model(args.model), world_size=args.world_size)
    print(
        f"{args.plan}: OK for {resolved.model_name} ({args.model}): {_mesh_words(plan)}, "
        f"{len(resolved.shards)} sharded modules, {len(resolved.stages)} stage{'s' if len(resolved.stages) != 1 else ''}"
    )
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from ..plan.schema import ParallelPlan

    sys.stdout.write(json.dumps(ParallelPlan.model_json_schema(), indent=2) + "\n")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, train_main

    config = TrainConfig(
        plan=args.plan,
        model=args.model,
        data=args.data,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        out_dir=args.out,
        parity=args.parity,
        progress=not args.no_progress,
        timeout_s=args.timeout,
    )
    train_main(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .presets import PRESETS

    model_help = _MODEL_HELP.format(presets=", ".join(PRESETS))
    parser = argparse.ArgumentParser(
        prog="rewrite",
        description="Declarative tensor- and pipeline-parallel plans for Hugging Face LLaMA-family models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    show = sub.add_parser("show", help="tables: module -> style -> per-rank shapes; stages; memory per rank")
    show.add_argument("plan", metavar="PLAN", help="a plan file (.yaml, .yml or .json)")
    show.add_argument("--model", required=True, metavar="MODEL", help=model_help)
    show.add_argument("--world-size", type=int, default=None, help="check the mesh against this many ranks")
    show.add_argument("--dtype", choices=_DTYPES, default=None, help="parameter dtype for the memory table (default float32)")
    show.add_argument("--schedule", action="store_true", help="also print the schedule table: each rank's actions and the predicted bubble")
    show.set_defaults(func=_cmd_show)

    validate = sub.add_parser("validate", help="check a plan (against a model); exit 1 listing every problem")
    validate.add_argument("plan", metavar="PLAN", help="a plan file (.yaml, .yml or .json)")
    validate.add_argument("--model", default=None, metavar="MODEL", help=model_help + " (omit: check the file only)")
    validate.add_argument("--world-size", type=int, default=None, help="check the mesh against this many ranks")
    validate.set_defaults(func=_cmd_validate)

    schema = sub.add_parser("schema", help="print the plan JSON schema (plans/plan.schema.json)")
    schema.set_defaults(func=_cmd_schema)

    from .train import TrainConfig

    d = TrainConfig.__dataclass_fields__
    train = sub.add_parser(
        "train",
        help="train under torchrun on byte-level text, with a parity check, timeline and loss curve",
        description="Run under torchrun, one process per rank of the plan's mesh, e.g. "
        "`torchrun --standalone --nproc-per-node 4 -m rewrite train plans/llama-tp2-pp2.yaml`. "
        "Several machines: torchrun's own --nnodes/--node-rank/--rdzv-endpoint flags.",
    )
    train.add_argument("plan", metavar="PLAN", help="a plan file (.yaml, .yml or .json)")
    train.add_argument("--model", default=d["model"].default, metavar="MODEL", help=model_help + " (default %(default)s)")
    train.add_argument("--data", default=None, help="a text file, trained on as bytes (default: data/alice29.txt)")
    train.add_argument("--steps", type=int, default=d["steps"].default, help="optimizer steps (default %(default)s)")
    train.add_argument("--batch-size", type=int, default=d["batch_size"].default, help="sequences per microbatch (default %(default)s)")
    train.add_argument("--seq-len", type=int, default=d["seq_len"].default, help="bytes per sequence (default %(default)s)")
    train.add_argument("--lr", type=float, default=d["lr"].default, help="AdamW learning rate (default %(default)s)")
    train.add_argument("--seed", type=int, default=d["seed"].default, help="model init and batch sampling seed (default %(default)s)")
    train.add_argument("--out", default=d["out_dir"].default, help="where rank 0 writes timeline.png, loss.png, metrics.json (default %(default)s)")
    train.add_argument("--no-parity", dest="parity", action="store_false", help="skip the single-process check of step 1")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (a line per step instead)")
    train.add_argument(
        "--timeout",
        type=float,
        default=d["timeout_s"].default,
        metavar="SECONDS",
        help="process-group timeout, > 0: a rank waiting longer than this in a collective (a peer stuck or "
        "gone) fails the run instead of holding every rank for torch's default 30 minutes (default "
        "%(default)g). Applies to the group `train` creates; a group the caller already initialised "
        "keeps its own timeout",
    )
    train.set_defaults(func=_cmd_train)
    return parser


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rewrite` console script. Returns the exit status.

    A bad plan, model or argument prints its message (every problem of a plan) on
    stderr and exits 1; under torchrun only rank 0 prints the problems every rank
    finds alike (the plan's, the settings'), other errors name their rank.
    """
    from ..plan.schema import PlanError
    from .train import TrainConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (PlanError, TrainConfigError) as exc:
        if _rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(1.0)  # torchrun stops every rank once one exits: let rank 0 print first
        return 1
    except ValueError as exc:
        prefix = f"[rank {_rank()}] " if "LOCAL_RANK" in os.environ else ""
        print(f"{prefix}error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `rewrite show ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
