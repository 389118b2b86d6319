"""Library messages in the command line's words.

The library names its parameters in backticks (`batch_size` is 0, `world=16`); the commands
print the flag that sets each one instead (--batch-size is 0, --world 16). Names without a
flag stay as written."""

from __future__ import annotations

import re

__all__ = ["FLAGS", "in_flags"]

# Parameter of the library -> the flag of the commands that pass it.
FLAGS = {
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "microbatches": "--microbatches",
    "world": "--world",
    "global_batch": "--global-batch",
    "gpus_per_node": "--gpus-per-node",
    "device_memory": "--device-memory",
    "dtype": "--dtype",
    "step": "--step",
    "keep": "--keep",
    "model": "--model",
}
_NAMED = re.compile(r"`(\w+)(?:=([^`]*))?`")


def in_flags(message: str) -> str:
    """`message` with every backticked parameter of `FLAGS` as its flag (`name=v` as `--flag v`)."""

    def flag(match: re.Match) -> str:
        name, value = match[1], match[2]
        if name not in FLAGS:
            return match[0]
        return FLAGS[name] + (f" {value}" if value is not None else "")

    return _NAMED.sub(flag, message)
