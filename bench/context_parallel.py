"""Context parallelism on the bench model at a long sequence: cp 2 against one process and against
tp 2, side by side, each a fresh set of processes per round (one torch thread per rank).

    .venv/bin/python -m bench.context_parallel                 # seq 4096, 3 rounds: several minutes
    .venv/bin/python -m bench.context_parallel --seq 2048 --rounds 1

Per layout and round: a training step's forward and backward (`run_schedule`, one microbatch of
one sequence; no optimizer), timed after a warm-up step, the slowest rank's; the activations
autograd saves for the backward on a rank, at their peak (`common.SavedTensors`); and under cp the
bytes a rank receives in the K/V all-gathers, against `2 x (cp - 1) / cp x seq x kv_heads x
head_dim x 4` per layer (`context_parallel.attention.gather_sequence`). Ratios are per round, then the median.
Targets: saved activations per rank at cp 2 <= 0.55x one process; the cp 2 step <= 0.60x. Beside
each layout's saved activations, `rewrite.estimate.rank_activations`' estimate for its plan.
"""

from __future__ import annotations

import argparse

import torch

import rewrite
from bench import common


def _plan(layout: str, seq: int) -> dict:
    pipeline = {"schedule": "afab", "microbatches": 1, "seq_len": seq}
    if layout == "one process":
        return {"pipeline": pipeline}
    if layout == "cp 2":
        return {"mesh": {"cp": 2}, "pipeline": pipeline}
    meta = common.build_model(common.MODEL, device="meta")
    return {"mesh": {"tp": 2}, "tensor_parallel": rewrite.plan_from_hf(meta.config, tp=2).tensor_parallel,
            "pipeline": pipeline}


def estimate(layout: str, seq: int) -> int:
    """The activation estimate of a layout's plan (its busiest rank), in bytes."""
    from rewrite.estimate import rank_activations

    meta = common.build_model(common.MODEL, device="meta")
    resolved = rewrite.resolve(rewrite.load_plan(_plan(layout, seq)), meta)
    return max(r.peak for r in rank_activations(resolved, meta))


def measure(rank: int, world: int, layout: str, seq: int, steps: int) -> dict:
    from rewrite.context_parallel import attention

    received = []
    gather = attention.all_gather_into

    def counting(out, x, group=None):  # what this rank receives: the others' shards
        received.append(out.numel() * out.element_size() - x.numel() * x.element_size())
        return gather(out, x, group)

    attention.all_gather_into = counting
    model = common.model()
    stage = rewrite.apply_plan(model, _plan(layout, seq))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = [ids[:, :-1].contiguous()], [ids[:, 1:].contiguous()]

    def step():
        rewrite.run_schedule(stage, inputs, targets)
        stage.model.zero_grad(set_to_none=True)

    saved = common.SavedTensors(stage.module)
    with saved.hooks():
        step()  # the warm-up, counted
    layers = model.config.num_hidden_layers
    per_layer = sum(received) / layers if received else 0  # k and v, in the forward (the backward reduce-scatters)
    received.clear()
    times = common.timed(step, warmup=0, steps=steps)
    return {"seconds": min(times), "saved": saved.peak, "kv_bytes_per_layer": per_layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="bench/results.json", help="results file (default %(default)s)")
    args = parser.parse_args()
    config = common.build_config(common.MODEL)
    kv, head = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    formula = 2 * (2 - 1) / 2 * args.seq * kv * head * 4
    rounds = []
    for r in range(args.rounds):
        got = {}
        for layout, world in (("one process", 1), ("cp 2", 2), ("tp 2", 2)):
            ranks = common.launch(measure, world, layout, args.seq, args.steps)
            got[layout] = {"seconds": max(x["seconds"] for x in ranks), "saved": max(x["saved"] for x in ranks),
                           "kv": ranks[0]["kv_bytes_per_layer"]}
        rounds.append(got)
        one = got["one process"]
        print(f"round {r + 1}: " + "; ".join(
            f"{k} {v['seconds']:.2f} s ({v['seconds'] / one['seconds']:.2f}x), saved {v['saved'] / 2**20:.1f} MiB "
            f"({v['saved'] / one['saved']:.2f}x)" for k, v in got.items()), flush=True)
    med = {k: {m: common.median([rd[k][m] / rd["one process"][m] for rd in rounds]) for m in ("seconds", "saved")}
           for k in ("cp 2", "tp 2")}
    kv_measured = rounds[0]["cp 2"]["kv"]
    estimates = {k: estimate(k, args.seq) for k in ("one process", "cp 2", "tp 2")}
    for k, v in estimates.items():
        measured = rounds[0][k]["saved"]
        print(f"{k}: saved activations {measured / 2**20:.1f} MiB measured, {v / 2**20:.1f} MiB estimated "
              f"({v / measured:.2f}x)")
    print(f"median over {args.rounds} rounds at seq {args.seq}: cp 2 step {med['cp 2']['seconds']:.2f}x one process "
          f"(target <= 0.60), saved activations {med['cp 2']['saved']:.2f}x (target <= 0.55); tp 2 step "
          f"{med['tp 2']['seconds']:.2f}x, saved {med['tp 2']['saved']:.2f}x; K/V received per layer under cp 2: "
          f"{kv_measured / 2**20:.2f} MiB measured, {formula / 2**20:.2f} MiB by the formula")
    common.save_result(args.out, "context parallel", {
        "seq": args.seq, "rounds": rounds, "median_ratio": med, "kv_bytes_per_layer": kv_measured, "estimates": estimates,
        "kv_bytes_formula": formula})


if __name__ == "__main__":
    main()
