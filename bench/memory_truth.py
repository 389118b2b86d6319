"""Memory per rank, measured against rewrite's estimate, for every shipped plan under every
schedule, data-parallel sharding and activation checkpointing.

    .venv/bin/python -m bench.memory_truth                      # about 15 minutes on 2 cores
    .venv/bin/python -m bench.memory_truth --plans llama-tp2,llama-pp2 --checkpointing off

Each shipped plan (`plans/*.yaml`) on the bench model, one step of 4 microbatches of [2, 128]
tokens (each replica its own), then one AdamW step, under each schedule (afab, 1f1b,
interleaved-1f1b, zero-bubble, zbv: two stages per rank where the schedule needs them), each
sharding (full, grad_op, replicate) where the plan has data parallelism, and activation
checkpointing off, every other layer and every layer. A combination the plan refuses is listed
with the refusal. Per rank, measured on the step itself (`memory_probe.StepSaved`): the most
bytes of saved activations alive at once (autograd's saved tensors, parameters excluded, plus
what checkpointed modules keep and recompute), and the parameters, gradients and AdamW moments
held after the step; against `rewrite.estimate.memory.rank_memory` of the same plan. Target:
every figure within 10 %. Writes the "memory_truth" entry of bench/results.json.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import yaml

import rewrite
from bench import common
from bench.memory_probe import StepSaved, state_bytes
from rewrite.estimate.activations import rank_activations
from rewrite.estimate.memory import SHARDINGS, rank_memory
from rewrite.estimate.search_space import CHECKPOINTING, checkpointed

SCHEDULES = ("afab", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
VIRTUAL_STAGES = {"interleaved-1f1b": 2, "zbv": 2}  # the others run one stage per rank
MICROBATCHES = 4
FIGURES = ("activations", "params", "grads", "adamw")
TARGET = 0.10


def variants(path: Path, meta, *, schedules=SCHEDULES, checkpointing=CHECKPOINTING) -> list[dict]:
    """Every combination of `path`'s plan: its data, or the reason the plan refuses it."""
    base = yaml.safe_load(path.read_text())
    base.setdefault("pipeline", {}).update(microbatches=MICROBATCHES, seq_len=common.SEQ)
    bound = rewrite.resolve(base, meta)
    dp = bound.plan.mesh.dp
    out = []
    for schedule in schedules:
        for sharding in SHARDINGS if dp > 1 else (None,):
            for mode in checkpointing:
                data = copy.deepcopy(base)
                data["pipeline"].update(schedule=schedule, virtual_stages=VIRTUAL_STAGES.get(schedule, 1))
                if sharding:
                    data.setdefault("data_parallel", {})["sharding"] = sharding
                data["activation_checkpointing"] = checkpointed(bound, mode)[0]
                label = " ".join(x for x in (schedule, sharding, f"ckpt {mode}") if x)
                try:
                    resolved = rewrite.resolve(data, meta)
                except (rewrite.PlanError, ValueError) as exc:
                    out.append({"plan": path.stem, "variant": label, "refused": str(exc).splitlines()[-1].strip()})
                    continue
                out.append({"plan": path.stem, "variant": label, "data": data, "estimate": _estimate(resolved, meta)})
    return out


def _estimate(resolved, meta) -> dict:
    """(pp_rank, tp_rank) -> the estimated figures, in bytes; every replica alike. Activations: what is kept and
    recomputed (`RankActivations.peak`), as measured here: the loss's transient buffers, which the memory
    estimate adds at its peak, are not saved tensors."""
    acts = rank_activations(resolved, meta, batch_size=common.MB)
    return {(m.pp_rank, m.tp_rank): {"activations": acts[m.pp_rank].peak, "recompute": acts[m.pp_rank].recompute,
                                     "params": m.weights, "grads": m.grads, "adamw": m.adamw}
            for m in rank_memory(resolved, meta, batch_size=common.MB)}


def measure(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """This rank's measured figures for each case, in order."""
    torch.manual_seed(0)
    out = []
    for case in cases:
        stage = rewrite.apply_plan(common.model(), case["data"])
        mesh = stage.mesh
        ids, targets = _batch(mesh.dp_rank)
        saved = StepSaved(stage)
        with saved.hooks():
            rewrite.run_schedule(stage, ids, targets)
        saved.close()
        optimizer = torch.optim.AdamW(stage.module.parameters(), lr=1e-4)
        optimizer.step()
        figures = state_bytes(stage.module, optimizer)
        figures.update(activations=saved.peak + saved.recompute, recompute=saved.recompute)
        out.append({"rank": rank, "pp_rank": mesh.pp_rank, "tp_rank": mesh.tp_rank, **figures})
        del stage, optimizer, saved
    return out


def _batch(dp_rank: int):
    gen = torch.Generator().manual_seed(1 + dp_rank)  # each replica its own sequences
    vocab = common.build_config(common.MODEL).vocab_size
    tokens = torch.randint(0, vocab, (MICROBATCHES, common.MB, common.SEQ + 1), generator=gen)
    return [t[:, :-1].contiguous() for t in tokens], [t[:, 1:].contiguous() for t in tokens]


def compare(cases: list[dict], measured: list[list[dict]]) -> list[dict]:
    """One row per (case, rank): measured, estimated, and measured / estimated - 1 per figure."""
    rows = []
    for i, case in enumerate(cases):
        for per_rank in measured:
            m = per_rank[i]
            est = case["estimate"][(m["pp_rank"], m["tp_rank"])]
            err = {f: (m[f] / est[f] - 1) if est[f] else (0.0 if not m[f] else float("inf")) for f in FIGURES}
            rows.append({"plan": case["plan"], "variant": case["variant"], "rank": m["rank"],
                         "measured": {f: m[f] for f in (*FIGURES, "recompute")},
                         "estimate": {f: est[f] for f in (*FIGURES, "recompute")}, "error": err})
    return rows


def summarize(rows: list[dict], refused: list[dict]) -> dict:
    """Counts over every rank row, the worst row per figure, and per case the rank worst on activations."""
    worst = {f: max(rows, key=lambda r: abs(r["error"][f])) for f in FIGURES}
    by_case: dict = {}
    for r in rows:
        key = (r["plan"], r["variant"])
        if key not in by_case or abs(r["error"]["activations"]) > abs(by_case[key]["error"]["activations"]):
            by_case[key] = r
    return {
        "cases": len(by_case),
        "rank_rows": len(rows),
        "within_target": {f: sum(abs(r["error"][f]) <= TARGET for r in rows) for f in FIGURES},
        "worst": {f: {"plan": w["plan"], "variant": w["variant"], "rank": w["rank"], "error": w["error"][f],
                      "measured": w["measured"][f], "estimate": w["estimate"][f]} for f, w in worst.items()},
        "refused": [{"plan": r["plan"], "variant": r["variant"], "why": r["refused"]} for r in refused],
        "worst_rank_per_case": list(by_case.values()),
    }


def table(res: dict) -> str:
    """Per plan: its cases and the range of each figure's error over every case's worst rank (all
    of them are in the results file)."""
    lines = ["| plan | cases | saved activations, error (each case's worst rank) | largest (measured / estimated MiB) "
             "| params | grads | AdamW |", "|---|---|---|---|---|---|---|"]
    plans: dict = {}
    for r in res["worst_rank_per_case"]:
        plans.setdefault(r["plan"], []).append(r)
    for plan, rows in plans.items():
        act = [r["error"]["activations"] for r in rows]
        big = max(rows, key=lambda r: r["measured"]["activations"])
        spans = [max(abs(r["error"][f]) for r in rows) for f in ("params", "grads", "adamw")]
        lines.append(f"| {plan} | {len(rows)} | {min(act):+.1%} .. {max(act):+.1%} | {big['variant']}: "
                     f"{big['measured']['activations'] / 2**20:.1f} / {big['estimate']['activations'] / 2**20:.1f} | "
                     + " | ".join(f"within {v:.1%}" for v in spans) + " |")
    n = res["rank_rows"]
    within = ", ".join(f"{f} {k}/{n}" for f, k in res["within_target"].items())
    worst = "; ".join(f"{f} {w['error']:+.1%} ({w['plan']} {w['variant']}, rank {w['rank']})" for f, w in res["worst"].items())
    refused = "".join(f"\n- refused: {r['plan']} {r['variant']}: {r['why']}" for r in res["refused"])
    return "\n".join(lines) + f"\n\n{res['cases']} cases, {n} rank rows within 10 %: {within}.\nWorst: {worst}.{refused}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", help="comma-separated plan names (default: every plans/*.yaml)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--checkpointing", default=",".join(CHECKPOINTING), help=f"of {', '.join(CHECKPOINTING)}")
    parser.add_argument("--out", default="bench/results.json", help="its 'memory_truth' entry is replaced")
    args = parser.parse_args()
    meta = common.build_model(common.MODEL, device="meta")
    paths = sorted(Path("plans").glob("*.yaml"))
    if args.plans:
        paths = [Path("plans") / f"{name}.yaml" for name in args.plans.split(",")]
    rows, refused = [], []
    for path in paths:
        cases = variants(path, meta, schedules=args.schedules.split(","), checkpointing=args.checkpointing.split(","))
        refused += [c for c in cases if "refused" in c]
        runnable = [c for c in cases if "refused" not in c]
        if runnable:
            world = rewrite.load_plan(runnable[0]["data"]).mesh.world_size
            measured = common.launch(measure, world, [{"data": c["data"]} for c in runnable])
            rows += compare(runnable, measured)
            print(f"{path.stem}: {len(runnable)} cases on {world} ranks", flush=True)
    res = summarize(rows, refused)
    print(table(res))
    common.save_result(args.out, "memory_truth", res)


if __name__ == "__main__":
    main()
