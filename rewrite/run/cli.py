"""The `rewrite` command: show, validate, schema, train, export, init-model.

    rewrite show plans/llama-tp2-pp2.yaml --model tiny-llama
    rewrite validate plans/llama-tp2-pp2.yaml --model path/to/config.json
    rewrite schema > plans/plan.schema.json
    torchrun --nproc-per-node 4 -m rewrite train plans/llama-tp2-pp2.yaml --model tiny-llama
    rewrite export ckpt/ out/model
    rewrite init-model models/tiny
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from collections.abc import Sequence

from .flag_words import in_flags

__all__ = ["main", "console", "build_parser"]


def _at_least_one(kind):
    """An argparse type: a number >= 1 (whole for int), or a usage error naming the value."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not value > 0 or (kind is int and value < 1):
            raise argparse.ArgumentTypeError(f"{text!r}: use a {'whole ' if kind is int else ''}number above 0")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    from .plan_cmd import add_calibrate_parser, add_hardware_flags, add_plan_parser
    from .presets import PRESETS
    from .train_flags import MODEL_HELP, PLAN_HELP, add_train_flags
    from .train_launch import add_launch_flags
    from .commands import cmd_export, cmd_init_model, cmd_schema, cmd_show, cmd_train, cmd_validate
    from .train_setup import DTYPES  # `--dtype` of show, plan and train: one meaning, one default

    parser = argparse.ArgumentParser(
        prog="rewrite",
        description="Parallel plans as data for Hugging Face decoder models (dense and mixtures of experts) and "
                    "torch.fx-traceable modules: tensor, sequence, vocabulary, context, expert, pipeline and data "
                    "parallelism. Write or generate a plan (plan), check it (validate, show), train under it (train), "
                    "export a Hugging Face checkpoint (export).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    show = sub.add_parser("show", help="tables: module -> style -> per-rank shapes; stages; memory per rank")
    show.add_argument("plan", metavar="PLAN", help=PLAN_HELP)
    show.add_argument("--model", required=True, metavar="MODEL", help=MODEL_HELP)
    show.add_argument("--world-size", type=int, default=None, help="check the mesh against this many ranks")
    show.add_argument("--dtype", choices=DTYPES, default=None,
                      help="compute dtype over float32 weights, gradients and AdamW state, as `rewrite train "
                      "--dtype` runs it (default: bfloat16 with a --hardware profile whose bfloat16 peak passes "
                      "its float32 one, a GPU's; else float32)")
    show.add_argument("--batch-size", type=_at_least_one(int), default=1, metavar="N",
                      help="sequences per microbatch, for the activations (default %(default)s)")
    show.add_argument("--seq-len", type=_at_least_one(int), default=None, metavar="TOKENS",
                      help="tokens per sequence, for the activations (default: the plan's pipeline.seq_len)")
    show.add_argument("--microbatches", type=_at_least_one(int), default=None, metavar="N",
                      help="microbatches per step, for the activations and --schedule (default: the plan's)")
    show.add_argument("--memory-limit", type=_at_least_one(float), default=None, metavar="GIB",
                      help="memory per rank in GiB: mark the ranks whose total exceeds it (still exits 0)")
    show.add_argument("--json", action="store_true",
                      help="print the same content as one JSON document (sizes in bytes) instead of tables")
    show.add_argument("--schedule", action="store_true", help="also print the schedule table: each rank's actions and the predicted bubble")
    add_hardware_flags(show, "predict the step time on this hardware: a profile name")
    show.set_defaults(func=cmd_show)

    validate = sub.add_parser("validate", help="check a plan (against a model); exit 1 listing every problem")
    validate.add_argument("plan", metavar="PLAN", help=PLAN_HELP)
    validate.add_argument("--model", default=None, metavar="MODEL", help=MODEL_HELP + " (omit: check the file only)")
    validate.add_argument("--world-size", type=int, default=None, help="check the mesh against this many ranks")
    validate.set_defaults(func=cmd_validate)

    schema = sub.add_parser("schema", help="print the plan JSON schema (plans/plan.schema.json)")
    schema.set_defaults(func=cmd_schema)

    train = sub.add_parser(
        "train",
        help="train a HF checkpoint and its tokenizer (or a preset on bytes) under a plan, resumable",
        description="One process per rank of the plan's mesh: `rewrite train plans/llama-tp2-pp2.yaml "
        "--nproc-per-node 4` starts them (torch's elastic launcher, as torchrun; several machines: the same "
        "command on each with --nnodes and --rdzv-endpoint), or run it under torchrun: `torchrun --standalone "
        "--nproc-per-node 4 -m rewrite train plans/llama-tp2-pp2.yaml`.",
    )
    add_train_flags(train)
    add_launch_flags(train)
    train.set_defaults(func=cmd_train)

    export = sub.add_parser("export", help="a training checkpoint (--ckpt DIR, any plan) to a plain Hugging Face one")
    export.add_argument("checkpoint", metavar="CKPT_DIR", help="a run's --ckpt directory (its latest step) or a step-N directory")
    export.add_argument("out", metavar="OUT_DIR", help="where the Hugging Face checkpoint and tokenizer go")
    export.add_argument("--step", type=int, default=None, help="export step N instead of the latest")
    export.add_argument("--adapter-only", action="store_true", help="a LoRA run's state: write its adapters as a "
                        "PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
    export.add_argument("--merge", metavar="BASE_DIR", default=None, help="a LoRA run's state: merge its adapters "
                        "into BASE_DIR, the Hugging Face checkpoint they were trained on, and write that model")
    export.set_defaults(func=cmd_export)

    init = sub.add_parser("init-model", help="a small Hugging Face model directory (random weights + BPE tokenizer)")
    init.add_argument("out", metavar="OUT_DIR", help="a new (or empty) directory")
    init.add_argument("--preset", default="tiny-llama", choices=sorted(PRESETS), help="model shape (default %(default)s)")
    init.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size (default %(default)s)")
    init.add_argument("--data", default=None, help="text to train the tokenizer on (default: data/alice29.txt)")
    init.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default %(default)s)")
    init.set_defaults(func=cmd_init_model)
    add_plan_parser(sub)
    add_calibrate_parser(sub)
    return parser


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rewrite` console script. Returns the exit status.

    A bad plan, model or argument prints its message (every problem of a plan) on
    stderr and exits 1; under torchrun one rank prints the problems every rank finds alike (the plan's, the
    settings', the data's: the first to find it once the ranks have met, else rank 0), other errors name their
    rank.
    """
    from ..errors import RewriteError
    from ..plan.schema import PlanError
    from .guard import TrainStopped
    from .signals import TrainInterrupted
    from .train import TrainConfigError

    args = build_parser().parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)  # as typed: a launcher hands it on
    try:
        return args.func(args)
    except TrainInterrupted as exc:  # a signal, the step finished and saved: one line, by rank 0
        if _rank() == 0:
            print(str(exc), file=sys.stderr, flush=True)
        return exc.status
    except KeyboardInterrupt as exc:  # a second Ctrl-C, or one outside the training loop: at once
        if getattr(exc, "says", _rank() == 0):  # the first rank to stop, where training ran
            print("interrupted: stopped at once, nothing more saved; --resume continues from the last complete "
                  "checkpoint, if the run saves one (--ckpt)", file=sys.stderr, flush=True)
        else:
            time.sleep(1.0)  # a launcher stops every rank once one exits: let the one saying it finish
        return 128 + signal.SIGINT
    except (PlanError, TrainConfigError, TrainStopped) as exc:
        if getattr(exc, "says", _rank() == 0):  # the first rank to find it where training ran, else rank 0
            print(f"error: {in_flags(str(exc))}", file=sys.stderr, flush=True)
        else:
            time.sleep(1.0)  # torchrun stops every rank once one exits: let the one saying it print first
        return 1
    except (ValueError, RewriteError) as exc:
        if not getattr(exc, "quiet", False):  # else another rank prints it
            prefix = f"[rank {_rank()}] " if "LOCAL_RANK" in os.environ else ""
            print(f"{prefix}error: {in_flags(str(exc))}", file=sys.stderr, flush=True)
        getattr(exc, "settle", lambda: None)()
        return 1
    except BrokenPipeError:  # `rewrite show ... | head`
        return 0


def console() -> None:
    """The `rewrite` console script and `python -m rewrite`: `main`, then exit with its status."""
    status = main()
    # The interpreter's collection at exit would walk every object torch and transformers made (~0.7 s
    # of a 10 s `rewrite plan`); frozen, they are left to the process's end.
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    console()
