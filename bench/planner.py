"""The planner against the clock: candidate plans' predicted step times against their measured
ones, side by side, with a profile calibrated on this machine first.

    .venv/bin/python -m bench.planner                 # about 10 minutes on 2 cores
    .venv/bin/python -m bench.planner --worlds 2 --steps 3
    .venv/bin/python -m bench.planner --model bench-qwen3-moe   # a second family: a mixture of experts
    .venv/bin/python -m bench.planner --compile --worlds 2       # every plan compiled, each beside itself eager

For each world (2 and 4 local ranks, one thread each): `rewrite.run.calibrate` measures a
profile with that many ranks at once (its layer terms on the model's own layers); every plan the search space holds for the bench model
(`seq_len` 128, a global batch of 16 sequences: meshes, schedules, microbatch counts,
sharding, switches, checkpointing) is predicted on it (`estimate.step_time.predict_step`);
`rewrite.suggest_plans` picks its top plan. Measured: the top pick, the best of every other
mesh, and plans spread over the predicted range, at least 8, in the same processes one at a time, each
as it runs alone: built, one step to warm up, its share of the timed steps, then dropped with its process
groups; two passes over the plans, the second in reverse (a step as `rewrite plan --measure` times it: `run_schedule`, the
gradient norm clipped, an AdamW update; from a barrier to the step's end on each rank, the slowest rank's); each is predicted too without the layers' collectives'
cost per call (`call_overhead_s`: tp, cp and ep), FSDP2's work per unit (`unit_overhead_s`) and the cores
the ranks share (`cores_per_node`), beside. Targets: the median
|measured / predicted - 1| within 10 %, every plan within 20 %, Spearman correlation of predicted
and measured >= 0.9, the top pick's measured step within 5 % of the best measured. Writes the
"planner" entry of bench/results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import rewrite
from bench import common
from rewrite.estimate.memory import SHARDINGS, rank_memory
from rewrite.estimate.plan_parts import selective_problem
from rewrite.plan.schema import Compile
from rewrite.estimate.search_space import (CHECKPOINTING, SCHEDULES_BY_STAGES, bind, binds_sp, divisors, expert_count,
                                           meshes, microbatch_counts, variant)
from rewrite.run.calibrate import calibrate, profile_yaml
from rewrite.run.measure import timing_step
from rewrite.schedules import schedule_rules

SEQ, BATCH, MEASURED = 128, 16, 10


def every_plan(meta, hw, world: int, compiled: bool = False) -> list[dict]:
    """Every candidate of the search space on `world` ranks, predicted: plan, batch_size, step_s, peak;
    `compiled`: each plan with `compile: true`."""
    out = []
    layers, experts = meta.config.num_hidden_layers, expert_count(meta)
    for dp, pp, cp, tp in meshes(world, world, layers):  # cp 1: the bench's 128 tokens are not worth splitting
        n = BATCH // dp
        for ep in [e for e in divisors(dp * tp) if experts % e == 0] if experts else [1]:
            for k in (1, 2) if pp > 1 else (1,):
                for vocab_loss in (False, True) if tp > 1 else (False,):
                    bind_with = dict(dp=dp, pp=pp, tp=tp, k=k, vocab_loss=vocab_loss, seq_len=SEQ, cp=cp, ep=ep)
                    base = bind(meta, sp=False, **bind_with)
                    if isinstance(base, str):
                        continue
                    bases = [base] + ([bind(meta, sp=True, **bind_with)] if tp > 1 and binds_sp(meta, base) else [])
                    for b in bases:
                        if compiled:
                            b = dataclasses.replace(b, plan=b.plan.model_copy(update={"compile": Compile()}))
                        out += _variants(b, meta, hw, n, k)
    return sorted(out, key=lambda c: c["step_s"])


def _variants(base, meta, hw, n: int, k: int) -> list[dict]:
    dp, pp = base.plan.mesh.dp, base.pp
    out = []
    for schedule in SCHEDULES_BY_STAGES[k] if pp > 1 else ("1f1b", "afab"):
        for m in microbatch_counts(n, pp * k):
            if schedule_rules(schedule, pp, k, m):
                continue
            for sharding in SHARDINGS if dp > 1 else ("full",):
                for mode in CHECKPOINTING:
                    if mode == "selective" and selective_problem(meta, cp=base.plan.mesh.cp):
                        continue  # not estimated for this family: not in the planner's search either
                    v = variant(base, schedule=schedule, microbatches=m, sharding=sharding, checkpointing=mode)
                    got = rewrite.predict_step(v, meta, hw, batch_size=n // m)
                    peak = max(r.total for r in rank_memory(v, meta, batch_size=n // m))
                    plan = v.plan.model_dump(mode="json", exclude_none=True)
                    out.append({"plan": plan, "batch_size": n // m, "step_s": got.step_s, "peak": peak,
                                "summary": rewrite.Candidate(v.plan, n // m, 0, 0, 0, 0, peak, True, mode).summary()})
    return out


def choose(every: list[dict], picks: list[rewrite.Candidate], count: int) -> list[dict]:
    """The planner's picks (its top first, then the best of each other mesh), then plans spread
    evenly over the predicted ranking, `count` in all, each once."""
    chosen = [{"plan": p.plan.model_dump(mode="json", exclude_none=True), "batch_size": p.batch_size,
               "step_s": p.step_s, "peak": p.peak_bytes, "summary": p.summary()} for p in picks][:count]
    known = {c["summary"] for c in chosen}
    spread = [every[round(i * (len(every) - 1) / max(count - 1, 1))] for i in range(count)]
    for c in spread + every:
        if len(chosen) >= count:
            break
        if c["summary"] not in known:
            known.add(c["summary"])
            chosen.append(c)
    return chosen


def measure(rank: int, world: int, model: str, chosen: list[dict], warmup: int, steps: int) -> list[list[float]]:
    """Seconds of each step of each chosen plan, one plan alive at a time (`common.one_plan_at_a_time`)."""
    compiled = any("compile" in c["plan"] for c in chosen)

    def build(j: int):
        if compiled:  # each plan's blocks compile afresh (not against the last one's recompile limit)
            torch.compiler.reset()
        stage, step = _step(model, chosen[j])

        def timed() -> float:
            # The ranks start together; each stops its clock where its step ends (the slowest rank's is the
            # step, as `predict_step` has it), not after the barrier that closes it: on ranks sharing cores
            # a barrier takes 8-25 ms (`bench.planner_parts`), which no plan spends; `rewrite plan --measure`
            # times alike.
            dist.barrier()
            start = time.perf_counter()
            step()
            took = time.perf_counter() - start
            dist.barrier()
            return took

        return stage, timed

    return common.one_plan_at_a_time(build, len(chosen), warmup=warmup, steps=steps)


def _step(model: str, candidate: dict):
    """A training step of the candidate as `rewrite plan --measure` times it (`run.measure.timing_step`)."""
    plan = rewrite.load_plan(candidate["plan"])
    stage = rewrite.apply_plan(common.build_model(model, seed=0), plan)
    vocab = common.build_config(model).vocab_size
    return stage, timing_step(stage, plan, candidate["batch_size"], SEQ, vocab)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                out[order[t]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def run_world(model: str, world: int, warmup: int, steps: int, compiled: bool = False) -> dict:
    found = calibrate(world, compiled=compiled, model=model)  # the layer terms fitted on the model measured
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(profile_yaml(found, name=f"this machine, {world} ranks"))
    hw = rewrite.load_hardware(f.name)
    Path(f.name).unlink()
    meta = common.build_model(model, device="meta")
    every = every_plan(meta, hw, world, compiled)
    picks = rewrite.suggest_plans(meta, world=world, seq_len=SEQ, global_batch=BATCH, hardware=hw, compiled=compiled)
    chosen = choose(every, picks, MEASURED)
    twins = eager_twins(chosen, meta, hw) if compiled else []
    per_rank = common.launch(measure, world, model, chosen + twins, warmup, steps)
    # The same plans without the layers' collectives' cost per call (`call_overhead_s`), FSDP2's per unit
    # (`unit_overhead_s`) and the cores the ranks share (`cores_per_node`), as before `calibrate` measured them.
    plain = hw.model_copy(update={"call_overhead_s": {}, "unit_overhead_s": {}, "cores_per_node": None})
    rows = []
    for j, c in enumerate(chosen):
        slow = [max(r[j][i] for r in per_rank) for i in range(steps)]  # a step is its slowest rank's
        resolved = rewrite.resolve(rewrite.load_plan(c["plan"]), meta)
        rows.append({"summary": c["summary"], "plan": c["plan"], "batch_size": c["batch_size"],
                     "predicted_s": c["step_s"], "measured_s": common.median(slow),
                     "plain_s": rewrite.predict_step(resolved, meta, plain, batch_size=c["batch_size"]).step_s,
                     "range_s": [min(slow), max(slow)], "peak_bytes": c["peak"], "top_pick": j == 0})
    best = min(r["measured_s"] for r in rows)
    measured = [r["measured_s"] for r in rows]
    choices = []
    for j, (c, e) in enumerate(zip(chosen, twins)):  # compiled against eager: predicted, then measured side by side
        slow = [[max(r[k][i] for r in per_rank) for i in range(steps)] for k in (j, len(chosen) + j)]
        choices.append({"summary": e["summary"], "predicted": c["step_s"] / e["step_s"],
                        "measured": common.median(slow[0]) / common.median(slow[1])})
    return {
        "model": model, "world": world, "compiled": compiled, "profile": {k: v for k, v in found.items() if k not in ("measured", "collective_times")},
        "collective_times": found["collective_times"], "candidates": len(every),
        "rows": rows, "top_pick_over_best": rows[0]["measured_s"] / best,
        "spearman": spearman([r["predicted_s"] for r in rows], measured),
        "spearman_plain": spearman([r["plain_s"] for r in rows], measured),
        "errors": errors([r["predicted_s"] for r in rows], measured),
        "errors_plain": errors([r["plain_s"] for r in rows], measured),
        "compile_choices": choices,
    }


def eager_twins(chosen: list[dict], meta, hw) -> list[dict]:
    """Each compiled plan of `chosen` without `compile`, predicted: what the planner weighs it against."""
    out = []
    for c in chosen:
        plan = {k: v for k, v in c["plan"].items() if k != "compile"}
        resolved = rewrite.resolve(rewrite.load_plan(plan), meta)
        out.append({**c, "plan": plan, "summary": c["summary"].removesuffix(", compiled"),
                    "step_s": rewrite.predict_step(resolved, meta, hw, batch_size=c["batch_size"]).step_s})
    return out


def errors(predicted: list[float], measured: list[float]) -> dict:
    """The median and worst |measured / predicted - 1|."""
    gaps = sorted(abs(m / p - 1) for p, m in zip(predicted, measured))
    return {"median": common.median(gaps), "worst": gaps[-1]}


def table(res: dict) -> str:
    how = ", compiled" if res.get("compiled") else ""
    lines = [f"{res['model']}{how}, world {res['world']}: {res['candidates']} candidates predicted, {len(res['rows'])} measured",
             "", "| plan | predicted (s) | measured (s), median (range) | measured / predicted | without the "
             "costs per call and per unit and shared cores: predicted (s), ratio |", "|---|---|---|---|---|"]
    for r in sorted(res["rows"], key=lambda r: r["measured_s"]):
        mark = " **(top pick)**" if r["top_pick"] else ""
        lo, hi = r["range_s"]
        lines.append(f"| {r['summary']}{mark} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} ({lo:.3f}-{hi:.3f}) "
                     f"| {r['measured_s'] / r['predicted_s']:.2f} | {r['plain_s']:.3f}, "
                     f"{r['measured_s'] / r['plain_s']:.2f} |")
    e, p = res["errors"], res["errors_plain"]
    lines.append(f"\ntop pick / best measured {res['top_pick_over_best']:.2f} (target <= 1.05); |measured / predicted - 1| "
                 f"median {e['median']:.0%}, worst {e['worst']:.0%} (targets 10 %, 20 %; without those "
                 f"terms {p['median']:.0%}, {p['worst']:.0%}); Spearman {res['spearman']:.2f} (target >= 0.9; "
                 f"without them {res['spearman_plain']:.2f})")
    if choices := res.get("compile_choices"):
        agree = sum((c["predicted"] < 1) == (c["measured"] < 1) for c in choices)
        lines += ["", "| plan | compiled / eager, predicted | measured |", "|---|---|---|"]
        lines += [f"| {c['summary']} | {c['predicted']:.2f} | {c['measured']:.2f} |" for c in choices]
        lines.append(f"\ncompile or not: the prediction picks the faster side for {agree} of {len(choices)} plans")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_flag(parser)
    parser.add_argument("--worlds", default="2,4", help="comma-separated local rank counts")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--out", default="bench/results.json",
                        help="its 'planner' entry ('planner MODEL' for another model) is replaced")
    parser.add_argument("--compile", action="store_true",
                        help="every plan compiled (`compile: true`), predicted with the compiled terms calibrate "
                        "measures, and each measured beside itself eager (compile or not, predicted against measured); "
                        "the warm-up steps compile (their kernels cached)")
    args = parser.parse_args()
    found = []
    for world in (int(w) for w in args.worlds.split(",")):
        found.append(run_world(args.model, world, args.warmup, args.steps, args.compile))
        print(table(found[-1]) + "\n", flush=True)
    key = common.result_key("planner", args.model)
    common.save_result(args.out, f"{key} compiled" if args.compile else key, found)


if __name__ == "__main__":
    main()
