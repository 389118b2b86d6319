"""Shared pieces of the benchmarks: the model, the data, launching ranks, timing.

Every measurement runs one torch thread per rank, on CPU with gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rewrite.run.presets import build_config, build_model

MODEL = "bench-llama"  # hidden 256, intermediate 688, 8 layers, 8 heads / 4 kv heads, vocab 4096
SEQ = 128
MICROBATCHES = 8
MB = 2


def batch(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """8 microbatches of [2, 128] token ids and their next-token targets."""
    vocab = build_config(MODEL).vocab_size
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (MICROBATCHES, MB, SEQ + 1), generator=gen)
    return [t[:, :-1].contiguous() for t in tokens], [t[:, 1:].contiguous() for t in tokens]


def model(seed: int = 0):
    return build_model(MODEL, seed=seed)


def accumulation_step(lm):
    """One step of plain gradient accumulation over the batch's microbatches."""
    from rewrite import causal_lm_loss

    ids, targets = batch()

    def step():
        for x, y in zip(ids, targets):
            (causal_lm_loss(lm(input_ids=x).logits, y) / len(ids)).backward()
        lm.zero_grad(set_to_none=True)

    return step


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def param_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            local = p.to_local() if hasattr(p, "to_local") else p  # DTensor: this rank's shard
            total += local.numel() * local.element_size()
    return total


class SavedTensors:
    """Bytes of the activations autograd keeps for backward: live now, and the most at once.

    Seen through `torch.autograd.graph.saved_tensors_hooks`, so it works for any runner
    that calls the module's forward on this thread. A storage counts once, however many
    saved tensors view it, from its first save until autograd drops the last of them;
    `module`'s parameters (which every matmul saves) do not count, nor the whole parameters FSDP2
    gathers into the modules for their forward (a replicated stage under dp x cp).

        >>> saved = SavedTensors(module)
        >>> with saved.hooks():
        ...     step()
        >>> saved.peak  # bytes
    """

    def __init__(self, module: torch.nn.Module):
        # A DTensor parameter (FSDP2's shard) keeps its storage in its local tensor.
        self.module = module
        self.params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in module.parameters()}
        self.refs: dict[int, int] = {}  # storage address -> saved tensors holding it
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor):
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor keeps its local shard's storage
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.params or ptr in self._gathered():
            return tensor
        if self.refs.get(ptr, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        # Detached: a saved output holding its own grad_fn would keep its graph alive in a cycle
        # autograd cannot break (a graph kept for a split backward never frees it).
        return _Saved(self, tensor.detach(), ptr, storage.nbytes())

    def _gathered(self) -> set[int]:
        # FSDP2 sets each module's parameters to their gathered (unsharded) copies for its forward:
        # read them as they are now, their storages freed and made again as the units reshard.
        return {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in self.module.parameters()}

    def _drop(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.live -= nbytes


class _Saved:
    """What autograd stores instead of a saved tensor; its deletion is the tensor's release."""

    def __init__(self, owner: SavedTensors, tensor: torch.Tensor, ptr: int, nbytes: int):
        self.owner, self.tensor, self.ptr, self.nbytes = owner, tensor, ptr, nbytes

    def __del__(self):
        self.owner._drop(self.ptr, self.nbytes)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed


def allocation_peak(fn) -> int:
    """Most bytes that `fn()` allocates and holds at once, from the profiler's allocator events.

    Counts every tensor the call allocates (activations, transfer buffers, gradients,
    temporaries) until it is freed. Memory allocated before the call is not seen, nor is
    its release during the call (the profiler drops frees of blocks it never saw allocated).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):  # stable: same-time events keep their order
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def timed(fn, *, warmup: int, steps: int, barrier: bool = True) -> list[float]:
    """Seconds per call of `fn`, after `warmup` untimed calls; ranks start each call together."""
    times = []
    for i in range(warmup + steps):
        if barrier and dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        if barrier and dist.is_initialized():
            dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def one_plan_at_a_time(build, count: int, *, warmup: int, steps: int, rounds: int = 2) -> list[list]:
    """Plans timed as each runs alone: `build(j)` gives plan j's (stage, step), `step()` what to record of one
    step; each plan is built, stepped `warmup` times untimed and its share of `steps` timed, then dropped with its
    process groups released before the next is built (ten plans' groups alive made a step 5-10 % longer on ranks
    sharing cores: `rewrite.mesh.release_groups`). `rounds` passes over the plans, every other in reverse,
    spread this machine's drift over all of them. Returns each plan's records, in the order taken."""
    import gc

    from rewrite.mesh import release_groups

    out: list[list] = [[] for _ in range(count)]
    for r in range(rounds):
        share = steps // rounds + (r < steps % rounds)
        for j in range(count) if r % 2 == 0 else reversed(range(count)):
            stage, step = build(j)
            for i in range(warmup + share):
                got = step()
                if i >= warmup:
                    out[j].append(got)
            mesh = stage.mesh
            del stage, step
            release_groups(mesh)
            del mesh
            gc.collect()
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


def _worker(rank: int, fn, world: int, init_file: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, *args) -> list:
    """Run `fn(rank, world, *args)` on `world` fresh processes; return each rank's result."""
    with tempfile.TemporaryDirectory(prefix="rewrite-bench-") as tmp:
        mp.start_processes(
            _worker,
            args=(fn, world, os.path.join(tmp, "rendezvous"), tmp, args),
            nprocs=world,
            start_method="spawn",
        )
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world)]


def single_process(fn, *args):
    """Run `fn(*args)` in one fresh process with one thread (a process group of one)."""
    return launch(_NoGroup(fn), 1, *args)[0]


class _NoGroup:
    """Picklable wrapper: call fn without the rank arguments."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, rank, world, *args):
        return self.fn(*args)


def add_model_flag(parser) -> None:
    """`--model`: the preset or config a bench runs on (default the bench LLaMA)."""
    parser.add_argument("--model", default=MODEL, help="a preset or config (default %(default)s)")


def result_key(name: str, model: str) -> str:
    """The results file's entry for bench `name` on `model`: `name` for the bench LLaMA, `name MODEL` else."""
    return name if model == MODEL else f"{name} {model}"


def step_parser(doc: str, *, steps: int, warmup: int = 2, per: str = "run",
                entry: str | None = None) -> argparse.ArgumentParser:
    """A timed bench's command line: its docstring's first line, `--steps` (timed, per `per`), `--warmup`
    (untimed, first) and, given the results entry it writes, `--out` (the results file)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per {per}")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    if entry is not None:
        parser.add_argument("--out", default="bench/results.json", help=f"its {entry!r} entry is replaced")
    return parser


def save_result(out: str | Path, key: str, value) -> None:
    """Replace the `key` entry of the results file `out` (JSON; made if missing), keeping the others."""
    path = Path(out)
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = value
    path.write_text(json.dumps(results, indent=2) + "\n")
