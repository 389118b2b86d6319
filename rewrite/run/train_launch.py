"""`rewrite train --nproc-per-node N`: torch's elastic launcher, the one torchrun runs, in this process.

The agent starts N workers on this node (`python -m rewrite train ...`, the same flags without
these), rendezvous with the other nodes' agents (`--nnodes`, `--rdzv-endpoint`) and restarts the
workers on a failure (`--max-restarts`), as torchrun does. A failed run has already said why:
its workers print rewrite's message once. This process then exits with the status of the first
rank that failed, instead of torchrun's ChildFailedError report; it speaks itself only for what no
worker could say (a worker killed by a signal, a rendezvous that failed).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid

from ..errors import first_line

__all__ = ["LAUNCH_FLAGS", "add_launch_flags", "split_launch_args", "launch_train"]

# (flag, argparse options): the launcher's own, taken out of the command the workers run.
LAUNCH_FLAGS = [
    ("--nproc-per-node", {"type": int, "metavar": "N", "help": "start N worker processes on this node and train "
                          "on them (torch's elastic launcher, as torchrun; every rank's setup here): one command "
                          "instead of `torchrun ... -m rewrite train`"}),
    ("--nnodes", {"default": "1", "metavar": "N|MIN:MAX", "help": "with --nproc-per-node: nodes taking part "
                  "(default %(default)s); every node runs the same command"}),
    ("--rdzv-endpoint", {"metavar": "HOST:PORT", "help": "with --nnodes > 1: where the nodes meet (a c10d store "
                         "hosted by the first node to arrive); one node alone needs none"}),
    ("--rdzv-id", {"default": "rewrite", "metavar": "ID", "help": "with --nnodes > 1: the run's id, the same on every "
                   "node (default %(default)s)"}),
    ("--max-restarts", {"type": int, "default": 0, "metavar": "K", "help": "with --nproc-per-node: start every worker "
                        "again up to K times when one fails (add --ckpt DIR --resume to go on from the last "
                        "checkpoint; default %(default)s)"}),
]
LAUNCH_DESTS = {flag.lstrip("-").replace("-", "_") for flag, _ in LAUNCH_FLAGS}


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    for flag, options in LAUNCH_FLAGS:
        parser.add_argument(flag, **options)


def split_launch_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's flags out of a `train` command line, and the rest: what each worker runs."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_launch_flags(parser)
    return parser.parse_known_args(argv)


def launch_train(launch: argparse.Namespace, worker_args: list[str]) -> int:
    """Run `rewrite train WORKER_ARGS` on `launch.nproc_per_node` workers here (and the other nodes'); the exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    problem = _problem(launch)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    low, _, high = launch.nnodes.partition(":")
    alone = int(high or low) == 1 and not launch.rdzv_endpoint
    config = LaunchConfig(
        min_nodes=int(low), max_nodes=int(high or low), nproc_per_node=launch.nproc_per_node,
        run_id=str(uuid.uuid4()) if alone else launch.rdzv_id, rdzv_backend="c10d",
        rdzv_endpoint="localhost:0" if alone else launch.rdzv_endpoint, max_restarts=launch.max_restarts,
        monitor_interval=0.2, logs_specs=DefaultLogsSpecs(), role="rewrite",
    )
    if launch.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks share this node's cores (torchrun's default too)
    # The agent's own log lines (each worker it stops, its failure report) say again what a worker said.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # each has a level of its own (elastic's get_logger)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "rewrite", "train", *worker_args)
        return 0
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        if failure.exitcode < 0:  # killed, not exited: no worker said why
            name = signal.Signals(-failure.exitcode).name
            print(f"error: rank {rank} was ended by {name}" + (" (out of memory? the kernel's OOM killer sends "
                  "it)" if name == "SIGKILL" else "") + "; the other ranks were stopped", file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode
    except SignalException as received:  # Ctrl-C or SIGTERM here: the workers were handed it and have finished
        return 128 + int(received.sigval)
    except (RuntimeError, ValueError) as exc:  # the rendezvous: nodes that never met, an endpoint that does not answer
        print(f"error: rewrite train --nproc-per-node: the workers could not start: {first_line(exc)}",
              file=sys.stderr)
        return 1


def _problem(launch: argparse.Namespace) -> str | None:
    if launch.nproc_per_node < 1:
        return f"--nproc-per-node is {launch.nproc_per_node}; use the number of processes to start here, >= 1"
    parts = launch.nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        return f"--nnodes is {launch.nnodes!r}; use a count of nodes (2) or a range (2:4)"
    if int(parts[-1]) > 1 and not launch.rdzv_endpoint:
        return f"--nnodes {launch.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node"
    if launch.max_restarts < 0:
        return f"--max-restarts is {launch.max_restarts}; use 0 or more"
    return None
