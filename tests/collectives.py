"""Counting the collectives a block of code makes, by patching the functions that make them.

Sums are counted at `comm.all_reduce_sum`, sequence gathers and reduce-scatters at
`comm.all_gather_into` / `comm.reduce_scatter_into` (over P2P on gloo, else torch.distributed),
and torch.distributed's own collectives where they are called.
"""

from __future__ import annotations

import torch.distributed as dist

from rewrite.tensor_parallel import comm


class CountCollectives:
    """`with CountCollectives() as seen: ...`; then `seen.counts[kind]` (kinds in TARGETS)."""

    TARGETS = {
        "all_reduce": (comm, "all_reduce_sum"),
        "all_gather": (dist, "all_gather"),
        "all_gather_into_tensor": (dist, "all_gather_into_tensor"),
        "reduce_scatter_tensor": (dist, "reduce_scatter_tensor"),
        "broadcast": (dist, "broadcast"),
        "sequence_all_gather": (comm, "all_gather_into"),
        "sequence_reduce_scatter": (comm, "reduce_scatter_into"),
    }

    def __enter__(self):
        self.counts = dict.fromkeys(self.TARGETS, 0)
        self.saved = {kind: getattr(module, name) for kind, (module, name) in self.TARGETS.items()}
        for kind, (module, name) in self.TARGETS.items():
            setattr(module, name, self._wrap(kind))
        return self

    def _wrap(self, kind):
        original = self.saved[kind]

        def counted(*args, **kwargs):
            self.counts[kind] += 1
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for kind, (module, name) in self.TARGETS.items():
            setattr(module, name, self.saved[kind])

    def made(self) -> dict[str, int]:
        """The kinds seen at least once."""
        return {kind: n for kind, n in self.counts.items() if n}
