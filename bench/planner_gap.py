"""Where a CPU step's time goes against what `estimate.step_time` charges for it, by profile.

    .venv/bin/python -m bench.planner_gap                # four plans of bench.planner, world 2
    .venv/bin/python -m bench.planner_gap --hardware FILE
    .venv/bin/python -m bench.planner_gap --layers       # one decoder layer's cost against the model's, by tokens

For each plan, one step per rank under torch.profiler (after a warm-up step), its operators' self
time in buckets: matrix products (aten::mm / addmm / bmm, with the FLOP/s they reached from their
shapes), attention (SDPA's CPU kernels), the other aten operators (elementwise, norms, the loss,
AdamW), gloo collectives, and what no operator accounts for (Python: the model's modules, the
runner). Beside it the model's own split of the same step: FLOPs at the profile's peak, memory
traffic at its bandwidth, the per-layer fixed cost, and the rest (collectives, waits), each from
`stage_times` on a profile with the other terms switched off.

`--layers`: one bench decoder layer's forward and backward (3 layers against 1, one process, the
best of 7) at several token counts, against the model's charge for it: its matmul FLOPs at the
profile's peak, its activation traffic at the bandwidth and the fixed `layer_overhead_s`.
"""

from __future__ import annotations

import argparse
import time

import torch

from torch.profiler import ProfilerActivity, profile

import rewrite
from bench import common
from bench.planner import BATCH, SEQ, _step

PLANS = {  # name: (plan, sequences per microbatch)
    "tp2 afab 16 x 1": ({"mesh": {"tp": 2}, "tensor_parallel": "llama",
                         "pipeline": {"schedule": "afab", "microbatches": 16, "seq_len": SEQ}}, 1),
    "tp2 1f1b 1 x 16 sp": ({"mesh": {"tp": 2}, "tensor_parallel": "llama", "sequence_parallel": True,
                            "loss_parallel": True, "pipeline": {"schedule": "1f1b", "microbatches": 1, "seq_len": SEQ}}, 16),
    "dp2 grad_op 1f1b 1 x 8": ({"mesh": {"dp": 2}, "data_parallel": {"sharding": "grad_op"},
                                "pipeline": {"schedule": "1f1b", "microbatches": 1, "seq_len": SEQ}}, 8),
    "dp2 grad_op afab 8 x 1": ({"mesh": {"dp": 2}, "data_parallel": {"sharding": "grad_op"},
                                "pipeline": {"schedule": "afab", "microbatches": 8, "seq_len": SEQ}}, 1),
    "pp2 zero-bubble 4 x 4": ({"mesh": {"pp": 2}, "pipeline": {"schedule": "zero-bubble", "microbatches": 4,
                                                               "seq_len": SEQ, "cut_points": "auto"}}, 4),
}
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _plan(name: str) -> tuple[dict, int]:
    plan, b = PLANS[name]
    plan = dict(plan)
    if plan.get("tensor_parallel") == "llama":
        meta = common.build_model(common.MODEL, device="meta")
        plan["tensor_parallel"] = rewrite.plan_from_hf(meta.config, tp=2).tensor_parallel
        if plan.get("loss_parallel"):
            plan["tensor_parallel"]["lm_head"] = "column"
    return plan, b


def _flops(event) -> float:
    shapes = [s for s in event.input_shapes if s]
    if event.name in ("aten::mm", "aten::addmm"):
        a, b = shapes[-2], shapes[-1]
        return 2.0 * a[0] * a[1] * b[1]
    if event.name in ("aten::bmm", "aten::baddbmm"):
        a, b = shapes[-2], shapes[-1]
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    return 0.0


def profiled(rank: int, world: int, name: str) -> dict:
    plan, b = _plan(name)
    _, step = _step(common.MODEL, {"plan": plan, "batch_size": b})
    step()
    plain = common.timed(step, warmup=0, steps=3)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    wall = time.perf_counter() - start
    buckets = {"matmul": 0.0, "attention": 0.0, "other aten": 0.0, "gloo": 0.0}
    flops = 0.0
    for e in prof.events():
        self_s = e.self_cpu_time_total / 1e6
        if e.name in MATMULS:
            buckets["matmul"] += self_s
            flops += _flops(e)
        elif "scaled_dot_product" in e.name or "flash_attention" in e.name:
            buckets["attention"] += self_s
        elif e.name.startswith("gloo:") or "c10d" in e.name:
            buckets["gloo"] += self_s
        elif e.name.startswith("aten::"):
            buckets["other aten"] += self_s
    buckets["outside operators"] = wall - sum(buckets.values())
    return {"wall_s": wall, "unprofiled_s": min(plain), "buckets": buckets, "matmul_flops": flops,
            "matmul_rate": flops / buckets["matmul"] if buckets["matmul"] else 0.0}


def predicted(name: str, hw) -> dict:
    """The model's split of the step: each term alone, the others switched off on the profile."""
    plan, b = _plan(name)
    meta = common.build_model(common.MODEL, device="meta")
    resolved = rewrite.resolve(plan, meta)
    inf = 1e30
    variants = {
        "total": hw,
        "flops": hw.model_copy(update={"memory_bandwidth": inf, "layer_overhead_s": 0.0}),
        "traffic": hw.model_copy(update={"peak_flops": {k: inf for k in hw.peak_flops}, "layer_overhead_s": 0.0}),
        "overhead": hw.model_copy(update={"peak_flops": {k: inf for k in hw.peak_flops}, "memory_bandwidth": inf}),
    }
    out = {k: rewrite.predict_step(resolved, meta, v, batch_size=b).step_s for k, v in variants.items()}
    return out


def layer_costs(hw, shapes=((1, 128), (2, 128), (8, 128), (1, 1024))) -> list[dict]:
    """One decoder layer's F + B measured, against the model's charge for it, at each (b, s)."""
    from rewrite.estimate.activations import Sizes, layer_bytes
    from rewrite.models.flops import layer_flop_parts

    torch.set_num_threads(1)
    out = []
    for b, s in shapes:
        seconds = {}
        for layers in (1, 3):
            config = common.build_config(common.MODEL, num_hidden_layers=layers)
            lm = common.build_model(config)
            ids = torch.randint(0, config.vocab_size, (b, s))
            seconds[layers] = min(common.timed(lambda: lm(input_ids=ids).logits.sum().backward(), warmup=1,
                                               steps=7, barrier=False))
        p = {k: v * b for k, v in layer_flop_parts(config, seq_len=s).items()}
        proj = p["q_o"] + p["k_v"]
        flops = 3 * proj + 4 * p["scores"] + 3 * p["mlp"] + 3 * p["norms"]  # F + I + W, as stage_time counts
        z = Sizes.of(config, seq_len=s, batch_size=b, tp=1, dtype_bytes=4, sequence_parallel=False,
                     qk_norm=False, kv_replicas=1)
        kept, _ = layer_bytes(z, attention_split=False, mlp_split=False)
        layer = (seconds[3] - seconds[1]) / 2
        out.append({"tokens": b * s, "measured_s": layer, "flops_s": flops / hw.flops("float32"),
                    "traffic_s": 5 * kept / hw.memory_bandwidth, "overhead_s": hw.layer_overhead_s})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--hardware", default="cpu", help="the profile predicted on (default %(default)s)")
    parser.add_argument("--layers", action="store_true", help="one decoder layer by token count instead")
    args = parser.parse_args()
    hw = rewrite.load_hardware(args.hardware)
    print(f"profile {hw.name}: {hw.peak_flops['float32'] / 1e9:.0f} GFLOP/s float32, "
          f"{hw.memory_bandwidth / 1e9:.1f} GB/s, layer overhead {hw.layer_overhead_s * 1e3:.2f} ms; "
          f"global batch {BATCH} x {SEQ} tokens")
    if args.layers:
        for r in layer_costs(hw):
            rest = r["measured_s"] - r["flops_s"]
            print(f"{r['tokens']} tokens: layer F+B {r['measured_s'] * 1e3:.2f} ms; FLOPs at peak {r['flops_s'] * 1e3:.2f}, "
                  f"the rest {rest * 1e3:.2f} against the model's traffic {r['traffic_s'] * 1e3:.2f} + overhead "
                  f"{r['overhead_s'] * 1e3:.2f}", flush=True)
        return
    for name in args.plans.split(","):
        ranks = common.launch(profiled, 2, name)
        got = max(ranks, key=lambda r: r["wall_s"])
        pred = predicted(name, hw)
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in got["buckets"].items())
        print(f"{name}: unprofiled {got['unprofiled_s'] * 1e3:.0f} ms; profiled {got['wall_s'] * 1e3:.0f} ms ({parts}); matmuls at "
              f"{got['matmul_rate'] / 1e9:.1f} GFLOP/s ({got['matmul_flops'] / 1e9:.2f} GFLOP)")
        print(f"  predicted {pred['total'] * 1e3:.0f} ms: FLOPs alone {pred['flops'] * 1e3:.0f}, traffic alone "
              f"{pred['traffic'] * 1e3:.0f}, overhead alone {pred['overhead'] * 1e3:.0f}", flush=True)


if __name__ == "__main__":
    main()
