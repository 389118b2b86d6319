"""Where the step time of the TP = 2 options goes: the same steps with communication replaced.

    .venv/bin/python -m bench.tp_profile             # about 1.5 minutes on 2 cores
    .venv/bin/python -m bench.tp_profile --steps 3
    .venv/bin/python -m bench.tp_profile --saved     # saved activations by module, with and without sp
    .venv/bin/python -m bench.tp_profile --ops       # self CPU time by kind of operator, compute only

Side by side in the same two processes, alternating step by step (`bench.tp_options`):

- `vocab+lp` and `vocab+lp+sp` as planned;
- `... no tp comm`: every tensor-parallel sum, gather and reduce-scatter skipped (each rank
  uses its own partial values: wrong numbers, the compute alone; the loss's small all-gather
  and the runner's input check stay), the norms' once-per-step gradient sum among them;
- one process, one thread, for scale.

Then one more step of each with every collective timed where it is called. Patches are
applied only inside their own run's step; nothing under rewrite/ is changed.

`--saved`: one step of `vocab+lp`, `vocab+lp+sp` and one process, with the bytes autograd
saves (`common.SavedTensors`' accounting) put down to the innermost module running when
each storage is first saved, per microbatch, layer indices folded into `*`.

`--ops`: `--steps` profiled steps each (alternating) of one process and of `vocab+lp` and
`vocab+lp+sp` with no tp communication (as above): self CPU time of matrix products,
attention kernels and the rest, and the operator count: what tensor parallelism divides and
what it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from bench import common, tp_options
from rewrite.tensor_parallel import comm, sequence


def _no_gather(x: torch.Tensor, group, length: int) -> torch.Tensor:
    return torch.cat([x] * comm.group_size(group), dim=-2).narrow(-2, 0, length).contiguous()


def _no_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    c = sequence.sequence_chunk(x.shape[-2], comm.group_size(group))
    return sequence._chunk(x, comm.group_rank(group), c).clone()


_NO_COMM = {(comm, "all_reduce_sum"): lambda x, group=None: x,
            (sequence, "_gather"): _no_gather, (sequence, "_reduce_scatter"): _no_reduce_scatter}

EXPERIMENTS: dict[str, tuple[str, dict]] = {
    "vocab+lp": ("vocab+lp", {}),
    "vocab+lp, no tp comm": ("vocab+lp", _NO_COMM),
    "vocab+lp+sp": ("vocab+lp+sp", {}),
    "vocab+lp+sp, no tp comm": ("vocab+lp+sp", _NO_COMM),
}


def _with(step, patches: dict):
    def run():
        with tp_options.patched(patches):
            return step()

    return run


def _timed_calls(step, experiment: dict) -> dict:
    """One step with every tp collective's wall time recorded, by kind: (count, total s, median ms); its loss."""
    waits: dict[str, list[float]] = {}

    def timing(kind, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            waits.setdefault(kind, []).append(time.perf_counter() - start)
            return out

        return run

    wrappers = {(comm, "all_reduce_sum"): "sum (P2P)", (sequence, "_gather"): "sequence all-gather",
                (sequence, "_reduce_scatter"): "sequence reduce-scatter"}
    with tp_options.patched(experiment):  # time what the experiment runs
        with tp_options.patched({key: timing(kind, getattr(*key)) for key, kind in wrappers.items()}):
            loss = step()
    return {"loss": loss, "calls": {k: (len(v), sum(v), 1e3 * statistics.median(v)) for k, v in waits.items()}}


def compare(rank: int, world: int, warmup: int, steps: int) -> dict:
    plans = {plan for plan, _ in EXPERIMENTS.values()}
    built = tp_options._build(rank, world, (tp_options.ONE, *sorted(plans)), "afab")
    runs = {tp_options.ONE: built[tp_options.ONE]}
    for key, (plan, patches) in EXPERIMENTS.items():
        module, step = built[plan]
        runs[key] = (module, _with(step, patches))
    times, _ = tp_options._take_turns(runs, warmup, steps)
    calls = {}
    for key, (plan, patches) in EXPERIMENTS.items():
        module, step = built[plan]
        dist.barrier()
        calls[key] = _timed_calls(step, patches)
        module.zero_grad(set_to_none=True)
    return {"times": times, "calls": calls}


class _SavedByModule(common.SavedTensors):
    """Saved bytes, each storage put down to the module whose forward first saved it."""

    def __init__(self, module, names: dict[int, str]):
        super().__init__(tp_options._LocalParams(module))
        self.names, self.stack = names, []
        self.by_module: dict[str, int] = defaultdict(int)

    def _pack(self, tensor):
        before = self.live
        out = super()._pack(tensor)
        if self.live > before:
            where = self.stack[-1] if self.stack else "(outside any module)"
            self.by_module[re.sub(r"\.\d+(\.|$)", r".*\1", where)] += self.live - before
        return out

    @contextlib.contextmanager
    def attributing(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):
            self.stack.append(self.names.get(id(module), type(module).__name__))

        def post(module, args, out):
            self.stack.pop()

        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        try:
            with self.hooks():
                yield
        finally:
            for h in handles:
                h.remove()


def saved_by_module(rank: int, world: int) -> dict:
    built = tp_options._build(rank, world, (tp_options.ONE, "vocab+lp", "vocab+lp+sp"), "afab")
    out = {}
    for key, (module, step) in built.items():
        dist.barrier()
        names = {id(m): name or "(model)" for name, m in module.named_modules()}
        saved = _SavedByModule(module, names)
        with saved.attributing():
            step()
        module.zero_grad(set_to_none=True)
        out[key] = {"peak": saved.peak, "by_module": dict(saved.by_module)}
    return out


def _print_saved(res: dict) -> None:
    mib, m = 2**20, common.MICROBATCHES
    keys = list(res)
    rows = sorted({k for r in res.values() for k in r["by_module"]}, key=lambda k: -res[keys[1]]["by_module"].get(k, 0))
    print("MiB saved per microbatch, rank 0, by module (all layers together)\n")
    print("| module | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{res[k]['by_module'].get(row, 0) / mib / m:.2f}" for k in keys) + " |")
    totals = [sum(res[k]["by_module"].values()) / mib / m for k in keys]
    print("| total | " + " | ".join(f"{t:.2f}" for t in totals) + " |")
    print("| peak over the step (all microbatches) | " + " | ".join(f"{res[k]['peak'] / mib:.1f}" for k in keys) + " |")


_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::baddbmm")


def _kind(name: str) -> str:
    if name.startswith(_MATMUL):
        return "matrix products"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention kernels"
    if name.startswith(("gloo:", "c10d::")):
        return "communication"
    return "everything else"


def ops(rank: int, world: int, rounds: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    built = tp_options._build(rank, world, (tp_options.ONE, "vocab+lp", "vocab+lp+sp"), "afab")
    runs = {tp_options.ONE: built[tp_options.ONE],
            "vocab+lp, no tp comm": (built["vocab+lp"][0], _with(built["vocab+lp"][1], _NO_COMM)),
            "vocab+lp+sp, no tp comm": (built["vocab+lp+sp"][0],
                                        _with(built["vocab+lp+sp"][1], _NO_COMM))}
    for module, step in runs.values():
        step()
        module.zero_grad(set_to_none=True)
    per_round: dict[str, list[dict]] = defaultdict(list)
    for i in range(rounds):  # alternate, as the timings do; the median round per kind
        for key in runs if i % 2 == 0 else list(runs)[::-1]:
            module, step = runs[key]
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            module.zero_grad(set_to_none=True)
            kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for e in prof.key_averages():
                kinds[_kind(e.key)][0] += e.self_cpu_time_total / 1e6
                kinds[_kind(e.key)][1] += e.count
            per_round[key].append(dict(kinds))
    return {key: {kind: [statistics.median(r.get(kind, [0.0, 0])[0] for r in rs), rs[0].get(kind, [0.0, 0])[1]]
                  for kind in {k for r in rs for k in r}} for key, rs in per_round.items()}


def _print_ops(res: dict) -> None:
    keys = list(res)
    kinds = ["matrix products", "attention kernels", "everything else", "communication"]
    print("self CPU s per step, median of the profiled steps (operators called), rank 0\n")
    print("| kind | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for kind in kinds:
        cells = [res[k].get(kind, [0.0, 0]) for k in keys]
        print(f"| {kind} | " + " | ".join(f"{s:.3f} ({n})" for s, n in cells) + " |")
    totals = [sum(v[0] for v in res[k].values()) for k in keys]
    print("| total | " + " | ".join(f"{t:.3f}" for t in totals) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--saved", action="store_true", help="saved activations by module instead")
    parser.add_argument("--ops", action="store_true", help="self CPU time by kind of operator instead")
    args = parser.parse_args()
    if args.ops:
        _print_ops(common.launch(ops, 2, args.steps)[0])
        return
    if args.saved:
        _print_saved(common.launch(saved_by_module, 2)[0])
        return
    runs = common.launch(compare, 2, args.warmup, args.steps)
    keys = list(runs[0]["times"])
    slow = {k: [max(r["times"][k][i] for r in runs) for i in range(args.steps)] for k in keys}
    med = {k: common.median(v) for k, v in slow.items()}
    one = med[tp_options.ONE]
    print("| run | median step (s) (range) | x one process |\n|---|---|---|")
    for k in keys:
        print(f"| {k} | {med[k]:.3f} ({min(slow[k]):.3f}-{max(slow[k]):.3f}) | {med[k] / one:.2f} |")
    print("\n| run | rank | loss | collective: count, total s, median ms |\n|---|---|---|---|")
    for k in runs[0]["calls"]:
        for rank, r in enumerate(runs):
            timed = r["calls"][k]
            calls = sorted(timed["calls"].items())
            text = "; ".join(f"{kind}: {n}, {s:.3f} s, {ms:.2f} ms" for kind, (n, s, ms) in calls)
            print(f"| {k} | {rank} | {timed['loss']:.6f} | {text} |")


if __name__ == "__main__":
    main()
