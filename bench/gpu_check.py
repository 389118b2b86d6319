"""The GPU check in one command: `python -m bench.gpu_check [--out FILE]`, one JSON document out.

On one CUDA device (or the CPU at tiny sizes, which is how the test suite keeps it working):
1. this device measured as a hardware profile (`rewrite.run.calibrate.device_rates`: matmul
   FLOP/s per dtype, memory bandwidth; links from the shipped profile of the same device, unused
   at one device), written beside the JSON as a YAML file `show --hardware` reads;
2. every plan switch that runs at world 1, under the bfloat16 recipe (`compute_dtype`), against
   the plain Hugging Face model's own forward under the same autocast: loss and every gradient;
3. a Llama-3.2-1B-shaped model (random weights) at sequence 2048, trained a few steps in the
   recipe: tokens/s, MFU and peak memory (`torch.cuda.max_memory_allocated`) measured, against
   what `rewrite show --hardware` predicts with the profile of step 1; then the same compiled
   (`compile`: inductor on the GPU, aot_eager on the CPU), its first step (the compile) timed, and
   compiled tokens/s over eager's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

import rewrite
from rewrite.estimate.hardware import load_hardware
from rewrite.run.calibrate import device_rates
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model, load_config

ROOT = Path(__file__).resolve().parent.parent
BF16 = torch.bfloat16
GRAD_RTOL = 2e-2  # bfloat16 keeps 8 mantissa bits: see tests/distributed/data_parallel/test_mixed_precision.py
# World-1 plans: each switch alone, on the whole model (mesh 1 x 1 x 1).
SWITCHES = {
    "plain": {},
    "afab, 2 microbatches": {"pipeline": {"schedule": "afab", "microbatches": 2}},
    "1f1b, 2 microbatches": {"pipeline": {"schedule": "1f1b", "microbatches": 2}},
    "activation checkpointing, layers": {"activation_checkpointing": {"model.layers.*": "full"}},
    "activation checkpointing, attention and mlp": {"activation_checkpointing": {
        "model.layers.*.self_attn": "full", "model.layers.*.mlp": "full"}},
    "sequence_parallel": {"sequence_parallel": True},
    "loss_parallel": {"loss_parallel": True},
}
# name -> (config, sequence length, sequences per microbatch, timed steps)
SIZES = {"cuda": (ROOT / "tests/configs/llama-3.2-1b.json", 2048, 4, 6), "cpu": ("tiny-llama", 64, 2, 2)}
SHIPPED = {"H200": "h200", "H100": "h100-sxm", "A100": "a100-80g"}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def profile(device: torch.device, out_dir: Path) -> tuple[Path, dict]:
    """This device as a hardware profile file: measured compute and memory, a shipped profile's links."""
    rates = device_rates(device, dtypes=("float32", "bfloat16"))  # the recipe is timed at bfloat16's peak
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        base = next((p for key, p in SHIPPED.items() if key in name), "h100-sxm")
        memory = torch.cuda.mem_get_info(device)[1] / 1024**3
    else:
        name, base, memory = "cpu", "cpu", load_hardware("cpu").memory_gib
    hw = load_hardware(base)
    data = hw.model_dump(mode="json")
    data.update(name="calibrated", memory_gib=memory, peak_flops=rates["flops"],
                memory_bandwidth=rates["memory_bandwidth"],
                description=f"{name}: compute and memory measured by bench.gpu_check; links from {base}")
    data["efficiency"]["matmul"] = 1.0  # the peak above is what the matmuls reached
    path = out_dir / "calibrated.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_hardware(path)  # a valid profile, or ValueError here
    return path, {"device": name, "base_profile": base, **data}


def switches(device: torch.device) -> list[dict]:
    """Each world-1 switch in the recipe against the plain model under the same autocast."""
    config = build_config("tiny-llama")
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, config.vocab_size, (2, 32), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, config.vocab_size, (2, 32), generator=gen) for _ in range(2)]
    out = []
    for name, plan in SWITCHES.items():
        model = build_model(config, seed=1, device=device)
        reference, exact = copy.deepcopy(model), copy.deepcopy(model)
        try:
            stage = rewrite.apply_plan(model, plan, compute_dtype=BF16)
        except ValueError as exc:
            out.append({"switch": name, "ran": False, "refused": " ".join(str(exc).split())[:400]})
            continue
        loss = rewrite.run_schedule(stage, ids, targets)
        on_device = [x.to(device) for x in ids], [y.to(device) for y in targets]
        with torch.autocast(device.type, dtype=BF16):
            expected = reference_step(reference, *on_device)
        reference_step(exact, *on_device)  # float32 throughout: the recipe must be measurably away from it
        ref, ref32 = dict(reference.named_parameters()), dict(exact.named_parameters())
        worst = max(_relative(p.grad, ref[n].grad) for n, p in model.named_parameters())
        away = max(_relative(p.grad, ref32[n].grad) for n, p in model.named_parameters())
        off = abs(float(loss) - float(expected)) / abs(float(expected))
        out.append({"switch": name, "ran": True, "by": stage.precision.by, "loss": float(loss),
                    "loss_relative": off, "grad_relative_max": worst, "float32_grad_relative_max": away,
                    "ok": off < 5e-3 and worst < GRAD_RTOL and away > 1e-4})
    return out


def throughput(device: torch.device, profile_path: Path, compile: dict | None = None) -> dict:
    """A 1B-shaped model (tiny on CPU) trained a few steps in the recipe (its blocks compiled with `compile`),
    against `show`'s prediction."""
    from rewrite.estimate.step_time import model_flops
    from rewrite.run.show.data import show_data

    source, seq, batch, steps = SIZES[device.type]
    config = load_config(str(source)) if isinstance(source, Path) else build_config(source)
    plan = {"pipeline": {"microbatches": 1, "seq_len": seq}, **({"compile": compile} if compile else {})}
    meta = build_model(config, device="meta", dtype=torch.float32)
    shown = show_data(rewrite.resolve(plan, meta), meta, batch_size=batch, hardware=profile_path, dtype="bfloat16")
    model = build_model(config, seed=0, device=device, dtype=torch.float32)  # float32 master weights
    stage = rewrite.apply_plan(model, plan, compute_dtype=BF16)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
    ids, targets = [tokens[:, :-1].contiguous()], [tokens[:, 1:].contiguous()]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses, first = [], [], 0.0
    for i in range(2 + steps):  # two warm-up steps
        sync()
        start = time.perf_counter()
        loss = rewrite.run_schedule(stage, ids, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
        elif i == 0:
            first = time.perf_counter() - start  # compiled: the compile (or its cache's read) and a step
        losses.append(float(loss))
    step = statistics.median(times)
    hw = load_hardware(profile_path)
    flops = model_flops(config, seq_len=seq, num_layers=config.num_hidden_layers,
                        has_head=True) * batch / step
    predicted, ranks = shown["predicted"], shown["memory"]["ranks"]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "config": str(source), "parameters": sum(p.numel() for p in model.parameters()), "seq_len": seq,
        "batch": batch, "steps_timed": steps, "step_s": step, "first_step_s": first, "compile": compile, "tokens_per_s": batch * seq / step,
        "mfu": flops / hw.flops("bfloat16" if "bfloat16" in hw.peak_flops else "float32"),
        "peak_memory_bytes": peak, "losses": losses,
        "predicted": {"step_s": predicted.get("step_s"), "tokens_per_s": predicted.get("tokens_per_s"),
                      "mfu": predicted.get("mfu"), "memory_bytes": max(r["total"] for r in ranks)},
        "measured_over_predicted": {
            "tokens_per_s": batch * seq / step / predicted["tokens_per_s"] if predicted.get("tokens_per_s") else None,
            "memory": peak / max(r["total"] for r in ranks) if peak else None},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, metavar="FILE", help="write the JSON here (and the profile beside it)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    out_dir = Path(args.out).resolve().parent if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if cuda:
        torch.cuda.set_device(device)
    store = os.path.join(tempfile.mkdtemp(prefix="gpu-check-group-"), "rendezvous")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(minutes=5))
    began = time.perf_counter()
    try:
        path, measured = profile(device, out_dir)
        result = {"device": measured["device"], "torch": torch.__version__, "profile_file": str(path),
                  "profile": measured, "switches": switches(device), "throughput": throughput(device, path)}
        backend = "inductor" if cuda else "aot_eager"  # the CPU run checks the path at its tiny size, quickly
        result["throughput_compiled"] = throughput(device, path, {"backend": backend})
        result["compiled_over_eager"] = (result["throughput_compiled"]["tokens_per_s"]
                                         / result["throughput"]["tokens_per_s"])
    finally:
        dist.destroy_process_group()
    result["seconds"] = time.perf_counter() - began
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    failed = [s["switch"] for s in result["switches"] if s["ran"] and not s["ok"]]
    if failed:
        print(f"gpu_check: {', '.join(failed)} differ from the plain model beyond bfloat16's tolerance", file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(1 if any(s["ran"] and not s["ok"] for s in main()["switches"]) else 0)
