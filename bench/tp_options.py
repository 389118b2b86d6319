"""TP = 2, rewrite's tensor-parallel options side by side with DTensor and one process.

    .venv/bin/python -m bench.tp_options              # about 4.5 minutes on 2 cores
    .venv/bin/python -m bench.tp_options --steps 3    # a quick look
    .venv/bin/python -m bench.tp_options --baselines  # which one-process baseline is the fair one
    .venv/bin/python -m bench.tp_options --runs vocab+lp,vocab+lp+ac --steps 9   # a subset; writes nothing

Runs, all in the same two processes and taking turns step by step (every other round in
reverse order), on the bench model and batch (`bench.common`):

- rewrite through the runner (`rewrite.run_schedule`, so the loss-parallel path is used):
  `plain` (the decoder layers sharded, as `base_model_tp_plan`), `vocab+lp` (plus the
  embedding as `vocab`, `lm_head` as `column` and `loss_parallel: true`), `vocab+lp+sp`
  (plus `sequence_parallel: true`), and each with `activation_checkpointing:
  {"model.layers.*": full}` (`+ac`);
- `plain-loop`: the plain plan stepped by calling `model(input_ids=...)` in a gradient
  accumulation loop, as `bench.tp` does (the runner's overhead, by difference);
- `dtensor`: `parallelize_module` with the model's `base_model_tp_plan`, the same loop;
- `one process`: the unsharded model, the same loop, on rank 0 with one thread while
  rank 1 waits in the barrier (its CPU time over those steps is recorded to show it idles).

Per run: median step (the slower rank's), parameter bytes per rank, and on one extra step
with the gradients already allocated: the peak bytes of saved activations
(`common.SavedTensors`: under checkpointing it sees the layers' kept inputs, not what the
backward recomputes) and the peak bytes the step allocates (`common.allocation_peak`: it
misses frees made on gloo's threads, so it over-counts runs that hand tensors to gloo's
collectives, sequence parallelism most), the step's loss, and its collectives. Writes the
"tp_options" entry of bench/results.json.

`--baselines` instead times plain tp against candidate one-process baselines, side by
side: rank 0 alone with one thread (the fair one), rank 0 alone with two threads, both
ranks each running the whole model at once (one thread each, and two: four threads on the
two cores), HF's own loss (`labels=`), an explicit all-ones attention mask, and eager
attention. Writes "tp_baselines".
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

import rewrite
from torch.profiler import ProfilerActivity, profile

from bench import common, tp
from rewrite.tensor_parallel import comm, sequence
from rewrite.tensor_parallel import loss as tp_loss

__all__ = ["PLANS", "compare", "baselines", "summarize", "table"]

_VOCAB = {"tensor_parallel": {"model.embed_tokens": "vocab", "lm_head": "column"}, "loss_parallel": True}
_SP = {"sequence_parallel": True}
_AC = {"activation_checkpointing": {"model.layers.*": "full"}}

# Plan additions on top of the decoder layers' rules (the model's base_model_tp_plan).
PLANS: dict[str, dict] = {
    "plain": {},
    "plain+ac": _AC,
    "vocab+lp": _VOCAB,
    "vocab+lp+ac": {**_VOCAB, **_AC},
    "vocab+lp+sp": {**_VOCAB, **_SP},
    "vocab+lp+sp+ac": {**_VOCAB, **_SP, **_AC},
}
ONE = "one process"


def _layer_rules(config, world: int) -> dict[str, str]:
    rules = rewrite.plan_from_hf(config, tp=world).tensor_parallel
    return {k: v for k, v in rules.items() if k.startswith("model.layers.")}  # as base_model_tp_plan


def plan_for(name: str, config, world: int, schedule: str = "afab") -> dict:
    """The plan dict of run `name` (a key of PLANS) at tp = `world`."""
    extra = dict(PLANS[name])
    rules = {**_layer_rules(config, world), **extra.pop("tensor_parallel", {})}
    return {"mesh": {"tp": world}, "tensor_parallel": rules,
            "pipeline": {"microbatches": common.MICROBATCHES, "schedule": schedule}, **extra}


def _loop(lm, *, hf_loss: bool = False, mask: bool = False):
    """One gradient-accumulation step over the batch, calling the model: returns the mean loss."""
    ids, targets = common.batch()

    def step():
        total = 0.0
        for x, y in zip(ids, targets):
            kwargs = {"attention_mask": torch.ones_like(x)} if mask else {}
            if hf_loss:
                # HF shifts `labels` itself: pass the unshifted sequence's ids as labels.
                loss = lm(input_ids=x, labels=x, **kwargs).loss
            else:
                loss = rewrite.causal_lm_loss(lm(input_ids=x, **kwargs).logits, y)
            (loss / len(ids)).backward()
            total += float(loss.detach()) / len(ids)
        return total

    return step


def _runner(lm, plan: dict):
    stage = rewrite.apply_plan(lm, plan)
    ids, targets = common.batch()
    return lambda: float(rewrite.run_schedule(stage, ids, targets))


def _idle():
    return None


class _LocalParams:
    """`module`'s parameters as local tensors (a DTensor's shard), for `common.SavedTensors`."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def parameters(self):
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.module.parameters()]


def _build(rank: int, world: int, names: tuple[str, ...], schedule: str) -> dict:
    """name -> (module holding this rank's parameters, step returning the loss or None)."""
    runs = {}
    for name in names:
        lm = common.model() if name != "dtensor" else None
        if name == ONE:
            runs[name] = (lm, _loop(lm) if rank == 0 else _idle)
        elif name == "dtensor":
            dt = tp._dtensor(world)[0]  # builds its own copy of the model
            runs[name] = (dt, _loop(dt))
        elif name == "plain-loop":
            rewrite.apply_plan(lm, plan_for("plain", lm.config, world))
            runs[name] = (lm, _loop(lm))
        else:
            runs[name] = (lm, _runner(lm, plan_for(name, lm.config, world, schedule)))
    return runs


def _take_turns(runs: dict, warmup: int, steps: int) -> tuple[dict, dict]:
    """Step times of every run, alternating; and this process's CPU seconds in each of those steps."""
    keys = list(runs)
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(warmup + steps):
        for key in keys if i % 2 == 0 else keys[::-1]:  # none always goes first
            module, step = runs[key]
            c0 = time.process_time()
            t = common.timed(step, warmup=0, steps=1)[0]
            c1 = time.process_time()
            module.zero_grad(set_to_none=True)
            if i >= warmup:
                times[key].append(t)
                cpu[key].append(c1 - c0)
    return times, cpu


def compare(rank: int, world: int, warmup: int, steps: int, schedule: str = "afab",
            names: tuple[str, ...] | None = None) -> dict:
    """Every run's step times, then per run one step for loss, collectives and memory."""
    names = names or (ONE, "dtensor", "plain-loop", *PLANS)
    runs = _build(rank, world, names, schedule)
    times, cpu = _take_turns(runs, warmup, steps)
    out = {"times": times, "cpu_s": cpu, "loss": {}, "collectives": {}, "memory": {}}
    for key, (module, step) in runs.items():
        dist.barrier()
        loss = step()
        out["loss"][key] = loss
        # Gradients stay allocated (zeroed), so the memory step sees activations and temporaries.
        module.zero_grad(set_to_none=False)
        dist.barrier()
        saved = common.SavedTensors(_LocalParams(module))
        with saved.hooks():
            allocated = common.allocation_peak(step)
        module.zero_grad(set_to_none=True)
        out["memory"][key] = {"param_bytes": common.param_bytes(module), "saved_peak_bytes": saved.peak,
                              "allocated_peak_bytes": allocated}
        dist.barrier()
        out["collectives"][key] = _collectives(step)
        module.zero_grad(set_to_none=True)
    return out


@contextlib.contextmanager
def patched(patches: dict):
    """Set `module.name = fn` for each `(module, name): fn` of `patches`, and put them back after."""
    saved = {key: getattr(*key) for key in patches}
    for (module, name), fn in patches.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def _collectives(step) -> dict:
    """Collectives of one step: count and bytes, by kind.

    rewrite's own are counted where they are made, whatever the transport: `sum`
    (`comm.all_reduce_sum`, P2P swaps on gloo), `sequence all_gather` and `sequence
    reduce_scatter` (bytes of this rank's chunk and of the whole tensor, respectively), and
    the vocabulary-parallel loss's `loss all_gather` (bytes gathered).
    gloo's collectives (DTensor's, the loss's, the runner's input check) come from the
    profiler as `gloo <name>` (fp32 bytes of their inputs); a rewrite call that falls back
    to a gloo collective would show in both.
    """
    out: dict[str, dict[str, int]] = {}

    def add(kind: str, nbytes: int) -> None:
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes

    def counting(kind, fn):
        def run(x, *args, **kwargs):
            add(kind, x.numel() * x.element_size())
            return fn(x, *args, **kwargs)

        return run

    wrappers = {(comm, "all_reduce_sum"): "sum", (sequence, "_gather"): "sequence all_gather",
                (sequence, "_reduce_scatter"): "sequence reduce_scatter", (tp_loss, "all_gather_into"): "loss all_gather"}
    with patched({key: counting(kind, getattr(*key)) for key, kind in wrappers.items()}):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
    for event in prof.events():
        if event.name.startswith(tp._COLLECTIVES):
            numel = sum(tp._numel(shape) for shape in event.input_shapes if shape)
            add("gloo " + event.name.removeprefix("gloo:"), 4 * numel)
    return out


def baselines(rank: int, world: int, warmup: int, steps: int) -> dict:
    """Plain tp against one-process candidates, side by side; CPU seconds per step on each rank."""
    runs = {}
    lm = common.model()
    rewrite.apply_plan(lm, plan_for("plain", lm.config, world))
    runs["tp plain-loop"] = (lm, _loop(lm))

    def alone(threads: int, *, everywhere: bool = False, **kwargs):
        model = common.model()
        if rank != 0 and not everywhere:
            return model, _idle
        inner = _loop(model, **kwargs)

        def step():
            torch.set_num_threads(threads)
            try:
                return inner()
            finally:
                torch.set_num_threads(1)

        return model, step

    runs["rank 0 alone, 1 thread"] = alone(1)
    runs["rank 0 alone, 2 threads"] = alone(2)
    both = common.model()
    runs["both ranks at once, 1 thread each"] = (both, _loop(both))
    runs["both ranks at once, 2 threads each"] = alone(2, everywhere=True)
    runs["rank 0 alone, HF labels= loss"] = alone(1, hf_loss=True)
    runs["rank 0 alone, attention_mask passed"] = alone(1, mask=True)
    eager = common.model()
    eager.config._attn_implementation = "eager"
    runs["rank 0 alone, eager attention"] = (eager, _loop(eager)) if rank == 0 else (eager, _idle)
    times, cpu = _take_turns(runs, warmup, steps)
    attn = {"bench model": common.model().config._attn_implementation,
            "eager run": eager.model.layers[0].self_attn.config._attn_implementation}
    return {"times": times, "cpu_s": cpu, "attn_implementation": attn}


def _slow(runs: list[dict], key: str) -> list[float]:
    n = len(runs[0]["times"][key])
    return [max(r["times"][key][i] for r in runs) for i in range(n)]


def paired(res: dict, a: str, b: str) -> float:
    """Median over rounds of a's step / b's step (slower rank each): less drift than a ratio of medians."""
    slow = {k: [max(ts) for ts in zip(*res["raw_times"][k])] for k in (a, b)}
    return common.median([x / y for x, y in zip(slow[a], slow[b])])


def summarize(runs: list[dict], schedule: str = "afab") -> dict:
    """Medians (slower rank per step), ratios to one process and DTensor, memory per rank."""
    keys = list(runs[0]["times"])
    med = {k: common.median(_slow(runs, k)) for k in keys}
    one, dt = med.get(ONE), med.get("dtensor")
    full_params = runs[0]["memory"][ONE]["param_bytes"] if ONE in keys else None
    res = {"schedule": schedule, "median_s": med,
           "range_s": {k: [min(_slow(runs, k)), max(_slow(runs, k))] for k in keys},
           "x_one_process": {k: v / one for k, v in med.items()} if one else {},
           "x_dtensor": {k: v / dt for k, v in med.items()} if dt else {},
           "idle_rank_cpu_s": common.median(runs[1]["cpu_s"][ONE]) if ONE in keys and len(runs) > 1 else None,
           "loss": runs[0]["loss"],
           "memory": {k: [r["memory"][k] for r in runs] for k in keys},
           "collectives": runs[0]["collectives"],
           "ideal_param_bytes_per_rank": full_params / len(runs) if full_params else None,
           "raw_times": {k: [r["times"][k] for r in runs] for k in keys}}
    return res


def table(res: dict) -> str:
    mib = 2**20
    rows = ["| run | median step (s) (range) | x one process | x DTensor | params per rank MiB (x ideal) "
            "| saved activations peak MiB, rank 0, 1 | allocated in step peak MiB, rank 0, 1 | loss |",
            "|---|---|---|---|---|---|---|---|"]
    ideal = res["ideal_param_bytes_per_rank"]
    for k, v in res["median_s"].items():
        lo, hi = res["range_s"][k]
        mem = res["memory"][k]
        params = max(m["param_bytes"] for m in mem)
        p = f"{params / mib:.2f}" + (f" ({params / ideal:.3f})" if ideal and k != ONE else "")
        shown = mem[:1] if k == ONE else mem  # rank 1 idles in the one-process run
        saved = ", ".join(f"{m['saved_peak_bytes'] / mib:.1f}" for m in shown)
        alloc = ", ".join(f"{m['allocated_peak_bytes'] / mib:.1f}" for m in shown)
        loss = res["loss"].get(k)
        x_one, x_dt = res["x_one_process"].get(k), res["x_dtensor"].get(k)
        rows.append(f"| {k} | {v:.3f} ({lo:.3f}-{hi:.3f}) | {'' if x_one is None else f'{x_one:.2f}'} "
                    f"| {'' if x_dt is None else f'{x_dt:.2f}'} | {p} | {saved} | {alloc} "
                    f"| {'' if loss is None else f'{loss:.6f}'} |")
    out = "\n".join(rows)
    if res.get("idle_rank_cpu_s") is not None:
        out += (f"\n\nrank 1's CPU time per one-process step (it only waits): {res['idle_rank_cpu_s']:.3f} s "
                f"of {res['median_s'][ONE]:.3f} s")
    lines = ["", "| run | collectives per step: count (MiB) |", "|---|---|"]
    for k, coll in res["collectives"].items():
        text = ", ".join(f"{n} {c['count']} ({c['bytes'] / mib:.1f})" for n, c in sorted(coll.items()))
        lines.append(f"| {k} | {text or 'none'} |")
    return out + "\n" + "\n".join(lines)


def targets(res: dict) -> str:
    """The targets against these figures: ratio of medians (median of the per-round ratios)."""
    med, mem = res["median_s"], res["memory"]
    peak = lambda k, f: max(m[f] for m in mem[k])  # noqa: E731
    ratio = lambda a, b: f"{med[a] / med[b]:.2f} ({paired(res, a, b):.2f})"  # noqa: E731
    lines = []
    if "vocab+lp" in med and res["ideal_param_bytes_per_rank"]:
        params = max(m["param_bytes"] for m in mem["vocab+lp"])
        ideal = res["ideal_param_bytes_per_rank"]
        lines.append(f"params per rank, vocab + column head: {params / ideal:.4f}x ideal (target within 2 %)")
    for k in ("plain", "vocab+lp", "vocab+lp+sp"):
        for ref, name, target in ((ONE, "one process", 0.75), ("dtensor", "DTensor", 0.45)):
            if k in med and ref in med:
                lines.append(f"{k}: {ratio(k, ref)} x {name} (target <= {target})")
    if "vocab+lp+sp" in med and "vocab+lp" in med:
        for f in ("saved_peak_bytes", "allocated_peak_bytes"):
            lines.append(f"sp / no sp, {f}: {peak('vocab+lp+sp', f) / peak('vocab+lp', f):.2f} (target <= 0.6)")
    for base in ("plain", "vocab+lp", "vocab+lp+sp"):
        ac = base + "+ac"
        if ac in med and base in med:
            saved, alloc = (peak(ac, f) / peak(base, f) for f in ("saved_peak_bytes", "allocated_peak_bytes"))
            lines.append(f"{ac} / {base}: saved peak {saved:.2f}, allocated peak {alloc:.2f} (target <= 0.5), "
                         f"step {ratio(ac, base)} (target <= 1.4)")
    return "\n".join(lines)


def baselines_table(runs: list[dict]) -> str:
    keys = list(runs[0]["times"])
    med = {k: common.median(_slow(runs, k)) for k in keys}
    tp_s = med["tp plain-loop"]
    rows = ["| run | median step (s) | tp plain / this | CPU s per step, rank 0, 1 |", "|---|---|---|---|"]
    for k in keys:
        cpu = ", ".join(f"{common.median(r['cpu_s'][k]):.2f}" for r in runs)
        rows.append(f"| {k} | {med[k]:.3f} | {tp_s / med[k]:.2f} | {cpu} |")
    return "\n".join(rows) + f"\n\nattention implementation: {runs[0]['attn_implementation']}"


def main() -> None:
    parser = common.step_parser(__doc__, steps=5, entry="tp_options")
    parser.add_argument("--schedule", default="afab", help="the rewrite runs' pipeline.schedule (pp = 1)")
    parser.add_argument("--runs", help=f"a comma-separated subset of: {ONE}, dtensor, plain-loop, "
                        f"{', '.join(PLANS)}; writes nothing")
    parser.add_argument("--baselines", action="store_true", help="compare one-process baselines instead")
    args = parser.parse_args()
    start = time.time()
    if args.baselines:
        runs = common.launch(baselines, 2, args.warmup, args.steps)
        print(baselines_table(runs))
        keys = list(runs[0]["times"])
        common.save_result(args.out, "tp_baselines", {"median_s": {k: common.median(_slow(runs, k)) for k in keys},
                                                      "raw": runs, "wall_s": time.time() - start})
        return
    names = tuple(n.strip() for n in args.runs.split(",")) if args.runs else None
    runs = common.launch(compare, 2, args.warmup, args.steps, args.schedule, names)
    res = summarize(runs, args.schedule)
    res["wall_s"] = time.time() - start
    print(table(res))
    print()
    print(targets(res))
    if names is None:
        common.save_result(args.out, "tp_options", res)


if __name__ == "__main__":
    main()
