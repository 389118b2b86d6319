"""Expert parallelism on the bench mixture of experts (`bench-qwen3-moe`: Qwen3-MoE's shape, hidden 256,
8 experts of width 256, 2 chosen per token, 8 layers): ep 2 (dp 2) against one process and against
transformers' own expert parallelism (`DistributedConfig(fsdp_size=2, ep_size=2)`: FSDP2 over 2 ranks,
experts split by all-to-all) on the same rows, side by side, each a fresh set of processes per round
(one torch thread per rank).

    .venv/bin/pip install -e ".[bench]"    # accelerate: transformers' distributed loading needs it
    .venv/bin/python -m bench.expert_parallel                 # 4 rows of 256 tokens a rank, 3 rounds
    .venv/bin/python -m bench.expert_parallel --rounds 1 --seq 128

Per layout and round: a training step's forward and backward (no optimizer), timed after a warm-up
step, the slowest rank's, the best of `--steps`. One process runs both ranks' rows (its step is the
work of two); rewrite's dp 2 x ep 2 runs `run_schedule` on each rank's rows (full sharding);
transformers' runs `model(input_ids, labels)` and its backward on the same rows. Under rewrite's ep,
the elements each rank sends per layer in the row exchanges, against the formula: `tokens x top_k x
hidden` each way (the dispatch also carries each row's routing weight: `+ tokens x top_k`).
Target: rewrite's ep 2 step <= 1.0x transformers' own.

    .venv/bin/python -m bench.expert_parallel --over-tp      # at tp 2: the experts whole, split over tp, ep 2

`--over-tp`: one replica's rows on 2 ranks at tp 2 (the family's tp plan for the attention), three ways
to hold the experts, side by side: whole on both ranks (each runs every token through them), each
expert split over tp (`expert_tensor_parallel`), and ep 2 over the tp pair (each rank half the experts
and half the tokens); against one process on the same rows.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import rewrite
from bench import common

MODEL = "bench-qwen3-moe"
RULE = {"model.layers.*.mlp.experts": "expert_parallel"}


def _rows(seq: int, rows: int, world: int) -> list[torch.Tensor]:
    """Each rank's rows, `[rows, seq + 1]` (inputs and shifted targets), the same in every layout."""
    vocab = common.build_config(MODEL).vocab_size
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (rows, seq + 1), generator=gen) for _ in range(world)]


def _stepper(model, plan: dict, ids: torch.Tensor):
    """(a training step of `plan` applied to `model` on rows `ids` (inputs and shifted targets), run once
    as a warm-up; the step's inputs)."""
    stage = rewrite.apply_plan(model, plan)
    inputs, targets = [ids[:, :-1].contiguous()], [ids[:, 1:].contiguous()]

    def step():
        rewrite.run_schedule(stage, inputs, targets)
        stage.model.zero_grad(set_to_none=True)

    step()
    return step, inputs


def rewrite_step(rank: int, world: int, layout: str, seq: int, rows: int, steps: int) -> dict:
    from rewrite.expert_parallel import dispatch

    sent = []
    exchange = dispatch.exchange_rows

    def counting(x, send, receive, group):
        sent.append(x.shape[0] * x.shape[1])  # elements this rank hands the all-to-all, its own rows included
        return exchange(x, send, receive, group)

    dispatch.exchange_rows = counting
    model = common.build_model(MODEL)
    mine = _rows(seq, rows, 2) if layout == "one process" else _rows(seq, rows, world)[rank:rank + 1]
    ids = torch.cat(mine)
    plan = {"pipeline": {"microbatches": 1, "seq_len": seq}}
    if layout == "rewrite ep 2":
        plan = {**plan, "mesh": {"dp": 2, "ep": 2}, "tensor_parallel": RULE}
    step, inputs = _stepper(model, plan, ids)
    layers = model.config.num_hidden_layers
    per_layer = [sum(sent[i::2 * layers]) for i in range(2)] if sent else [0, 0]  # dispatch, combine: layer 0
    times = common.timed(step, warmup=0, steps=steps)
    return {"seconds": min(times), "sent_dispatch": per_layer[0], "sent_combine": per_layer[1],
            "tokens": inputs[0].numel()}


def transformers_step(rank: int, world: int, directory: str, seq: int, rows: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))
    ids = _rows(seq, rows, world)[rank]
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step():
        # Labels already shifted: transformers shifts them again, so the loss is over one token
        # fewer a row than rewrite's, the same work otherwise.
        model(input_ids=inputs, labels=labels).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    return {"seconds": min(common.timed(step, warmup=0, steps=steps))}


OVER_TP = {"tp 2, experts whole": {"tp": 2}, "tp 2, experts over tp": {"tp": 2}, "tp 2, ep 2 over tp": {"tp": 2, "ep": 2}}


def tp_step(rank: int, world: int, layout: str, seq: int, rows: int, steps: int) -> dict:
    model = common.build_model(MODEL)
    ids = _rows(seq, rows, 1)[0]
    plan = {"pipeline": {"microbatches": 1, "seq_len": seq}}
    if layout in OVER_TP:
        plan = {**rewrite.plan_from_hf(model, **OVER_TP[layout]).model_dump(), **plan}
        if layout.endswith("experts whole"):
            plan["tensor_parallel"]["model.layers.*.mlp.experts"] = "expert_parallel"
    step, _ = _stepper(model, plan, ids)
    return {"seconds": min(common.timed(step, warmup=0, steps=steps))}


def over_tp(args) -> None:
    rounds = []
    for r in range(args.rounds):
        got = {"one process": max(x["seconds"] for x in common.launch(tp_step, 1, "one process", args.seq,
                                                                       args.rows, args.steps))}
        for layout in OVER_TP:
            got[layout] = max(x["seconds"] for x in common.launch(tp_step, 2, layout, args.seq, args.rows, args.steps))
        rounds.append(got)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in got.items()), flush=True)
    whole = common.median([rd["tp 2, experts whole"] for rd in rounds])
    print(f"median over {args.rounds} rounds, {args.rows} rows of {args.seq} tokens: " + ", ".join(
        f"{k} {common.median([rd[k] for rd in rounds]) / whole:.2f}x" for k in rounds[0]) + " the experts whole")
    common.save_result(args.out, "expert parallel over tp", {"seq": args.seq, "rows": args.rows, "rounds": rounds})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4, help="rows a rank trains on per step (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="bench/results.json", help="results file (default %(default)s)")
    parser.add_argument("--over-tp", action="store_true", help="at tp 2: the experts whole, split over tp, ep 2")
    args = parser.parse_args()
    if args.over_tp:
        over_tp(args)
        return
    config = common.build_config(MODEL)
    with tempfile.TemporaryDirectory(prefix="rewrite-bench-moe-") as tmp:
        common.build_model(MODEL).save_pretrained(tmp)
        rounds = []
        for r in range(args.rounds):
            got = {}
            for layout, world in (("one process", 1), ("rewrite ep 2", 2)):
                ranks = common.launch(rewrite_step, world, layout, args.seq, args.rows, args.steps)
                got[layout] = {**ranks[0], "seconds": max(x["seconds"] for x in ranks)}
            ranks = common.launch(transformers_step, 2, tmp, args.seq, args.rows, args.steps)
            got["transformers ep 2"] = {"seconds": max(x["seconds"] for x in ranks)}
            rounds.append(got)
            one, ours, theirs = (got[k]["seconds"] for k in ("one process", "rewrite ep 2", "transformers ep 2"))
            print(f"round {r + 1}: one process (both ranks' rows) {one:.2f} s, rewrite ep 2 {ours:.2f} s "
                  f"({ours / one:.2f}x), transformers ep 2 {theirs:.2f} s; rewrite / transformers "
                  f"{ours / theirs:.2f}x", flush=True)
    ratio = common.median([rd["rewrite ep 2"]["seconds"] / rd["transformers ep 2"]["seconds"] for rd in rounds])
    vs_one = common.median([rd["rewrite ep 2"]["seconds"] / rd["one process"]["seconds"] for rd in rounds])
    ep = rounds[0]["rewrite ep 2"]
    formula = ep["tokens"] * config.num_experts_per_tok * config.hidden_size
    print(f"median over {args.rounds} rounds, {args.rows} rows of {args.seq} tokens a rank: rewrite ep 2 step "
          f"{ratio:.2f}x transformers' own ep 2 (target <= 1.0), {vs_one:.2f}x one process running both ranks' rows; "
          f"elements a rank sends per layer: dispatch {ep['sent_dispatch']:,} (formula {formula:,} + "
          f"{formula // config.hidden_size:,} weights), combine {ep['sent_combine']:,} (formula {formula:,})")
    common.save_result(args.out, "expert parallel", {
        "seq": args.seq, "rows": args.rows, "rounds": rounds, "ratio_vs_transformers": ratio, "ratio_vs_one": vs_one,
        "formula_elements_per_layer": formula})


if __name__ == "__main__":
    main()
