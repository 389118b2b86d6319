"""LoRA steps: rank-16 adapters against full fine-tuning under the same plan, against PEFT + torch's FSDP2,
and each rank's memory against `show`'s estimate.

    .venv/bin/python -m bench.lora                          # about 8 minutes on 2 cores
    .venv/bin/python -m bench.lora --rounds 1 --steps 2     # a quick look

The bench model in float32, one step of the global batch (`common.batch`: 8 microbatches of [2, 128]),
adapters of rank 16 (alpha 16) on every decoder layer's projections, dropout 0. Each side runs alone in a
fresh pair of processes (as `bench.turns`), the sides of a pair one after the other, their order turned
every round; a run's time is the median over its steps of the slower rank's. Pairs:
- tp 2: rewrite's LoRA step against its full fine-tuning step (reported);
- dp 2 `full`: the same (reported);
- dp 2 `full`: rewrite's LoRA step against PEFT's `get_peft_model` with torch's `fully_shard` per decoder
  layer and at the root, gradient sync off but for the last microbatch (target <= 1.0).
Memory: one LoRA step at tp 2 and at dp 2 `full` then an AdamW step; per rank the most saved-activation
bytes alive at once and the parameter, gradient and AdamW bytes held, against `rewrite.estimate.memory`
(target: each within 10 %). Writes the "lora" entry of bench/results.json.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

import rewrite
from bench import common, dp, turns
from bench.memory_probe import StepSaved, state_bytes
from rewrite.estimate.activations import rank_activations
from rewrite.estimate.memory import rank_memory

WORLD = 2
LORA = {"rank": 16, "alpha": 16.0}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAIRS = {  # name: (first side, second side); the ratio is first / second
    "tp2 lora / tp2 full": ("rewrite tp2 lora", "rewrite tp2 full"),
    "dp2 lora / dp2 full": ("rewrite dp2 lora", "rewrite dp2 full"),
    "dp2 lora / PEFT + FSDP2": ("rewrite dp2 lora", "PEFT + torch FSDP2"),
}
TARGET = 0.10


def _plan(side: str, microbatches: int) -> dict:
    mesh = {"tp": WORLD} if "tp2" in side else {"dp": WORLD}
    plan = {"mesh": mesh, "pipeline": {"microbatches": microbatches, "seq_len": common.SEQ}}
    if "tp2" in side:
        plan["tensor_parallel"] = rewrite.plan_from_hf(common.model(), tp=WORLD).tensor_parallel
    if "lora" in side:
        plan["lora"] = LORA
    return plan


def _mine(rank: int, side: str):
    ids, targets = common.batch()
    if "dp2" in side or "PEFT" in side:
        return dp._mine(rank)
    return ids, targets


def _build(rank: int, world: int, side: str):
    """(module, step) of one side; `step()` runs one training step, gradients left to clear."""
    torch.manual_seed(0)
    ids, targets = _mine(rank, side)
    if side.startswith("rewrite"):
        stage = rewrite.apply_plan(common.model(), _plan(side, len(ids)))
        return stage.module, lambda: rewrite.run_schedule(stage, ids, targets)
    import peft
    from torch.distributed.fsdp import fully_shard

    lm = peft.get_peft_model(common.model(), peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                                             lora_dropout=0.0, target_modules=PROJECTIONS))
    for layer in lm.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(lm)

    @contextmanager
    def sync(last: bool):
        lm.set_requires_gradient_sync(last)
        yield

    return lm, lambda: dp._accumulate(lm, ids, targets, sync)


def memory(rank: int, world: int) -> list[dict]:
    """This rank's measured and estimated figures for one LoRA step at tp 2 and at dp 2 `full`."""
    out = []
    for side in ("rewrite tp2 lora", "rewrite dp2 lora"):
        ids, targets = _mine(rank, side)
        plan = _plan(side, len(ids))
        meta = common.model()
        resolved = rewrite.resolve(plan, meta)
        acts = rank_activations(resolved, meta, batch_size=common.MB)[0]
        est = next(m for m in rank_memory(resolved, meta, batch_size=common.MB) if m.tp_rank == rank % resolved.tp)
        torch.manual_seed(0)
        stage = rewrite.apply_plan(common.model(), plan)
        saved = StepSaved(stage)
        with saved.hooks():
            rewrite.run_schedule(stage, ids, targets)
        saved.close()
        optimizer = torch.optim.AdamW([p for p in stage.module.parameters() if p.requires_grad], lr=1e-4)
        optimizer.step()
        measured = {**state_bytes(stage.module, optimizer), "activations": saved.peak + saved.recompute}
        estimated = {"params": est.weights, "grads": est.grads, "adamw": est.adamw, "activations": acts.peak}
        out.append({"case": side, "rank": rank, "measured": measured, "estimated": estimated,
                    "error": {k: measured[k] / estimated[k] - 1 for k in measured}})
        dist.barrier()
    return out


def profile() -> dict:
    """One process, one thread: a full fine-tuning step and a LoRA step of the batch under torch's profiler; per
    side the step's seconds, the seconds in matrix products, their count and every operator call's."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiled

    from rewrite.lora import apply_lora

    torch.set_num_threads(1)
    ids, targets = common.batch()
    out = {}
    for side, lora in (("full", None), ("lora", LORA)):
        lm = common.model()
        if lora:
            apply_lora(lm, rewrite.resolve({"lora": lora}, lm))

        def step():
            for x, y in zip(ids, targets):
                (rewrite.causal_lm_loss(lm(input_ids=x).logits, y) / len(ids)).backward()
            lm.zero_grad(set_to_none=True)

        step()  # warm-up
        with profiled(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
        events = prof.key_averages()
        products = [e for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
        out[side] = {"step_s": seconds, "products_s": sum(e.self_cpu_time_total for e in products) / 1e6,
                     "products": sum(e.count for e in products),
                     "operator_calls": sum(e.count for e in events if e.key.startswith("aten::"))}
        print(f"{side}: step {seconds:.3f} s, {out[side]['products_s']:.3f} s in {out[side]['products']} products, "
              f"{out[side]['operator_calls']} operator calls", flush=True)
    return out


def table(res: dict, rows: list[dict]) -> str:
    lines = [turns.table(res, PAIRS, heads=("first", "second"), by_name=True), "",
             "| case | rank | figure | measured MiB | estimated MiB | measured / estimated - 1 |", "|---|---|---|---|---|---|"]
    for row in rows:
        for k in ("params", "grads", "adamw", "activations"):
            lines.append(f"| {row['case']} | {row['rank']} | {k} | {row['measured'][k] / 2**20:.2f} | "
                         f"{row['estimated'][k] / 2**20:.2f} | {row['error'][k]:+.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = turns.turn_flags(__doc__.splitlines()[0], PAIRS)
    parser.add_argument("--profile", action="store_true", help="only the one-process profile of a full and a LoRA step")
    args = parser.parse_args()
    if args.profile:
        common.save_result(args.out, "lora profile", profile())
        return
    pairs = turns.chosen_pairs(parser, args, PAIRS)
    res = turns.measure(pairs, args.rounds, args.warmup, args.steps, sides=PAIRS, build=_build)
    rows = [row for rank_rows in common.launch(memory, WORLD) for row in rank_rows]
    print(table(res, rows))
    worst = max(abs(e) for row in rows for e in row["error"].values())
    print(f"memory: worst |measured / estimated - 1| = {worst:.1%} (target {TARGET:.0%})")
    common.save_result(args.out, "lora", {"rounds": args.rounds, "steps": args.steps, "lora": LORA, "pairs": res,
                                          "memory": rows, "worst_memory_error": worst})


if __name__ == "__main__":
    main()
