"""`rewrite calibrate`: measure this machine into a hardware profile (`rewrite.estimate.hardware`).

N local ranks (one torch thread each, as `rewrite train` runs them on CPU) measure at once:
matmul throughput at transformer shapes, memory bandwidth, a decoder layer's fixed cost and its
elementwise operators' bandwidth, eager and compiled, a microbatch's cost outside its layers, a step's
end (the gradients' norm and AdamW), a tp 2 layer's collectives and an ep 2 layer's all-to-alls beyond
their time alone (`calibrate_layers`, `calibrate_experts`), a selectively checkpointed layer's policy
(`calibrate_selective`), a context-parallel layer's own work (`calibrate_cp`) and FSDP2's own work per
unit (`calibrate_units`), then point-to-point and all-reduce times between them on the current backend
(latency and bandwidth are fitted to the times), and each collective a run makes by size and group
(`calibrate_links`); `calibrate_profile` writes them as a profile.
"""

from __future__ import annotations

import statistics

from ..lent import lend
from .calibrate_cp import context_layer_gaps, context_work
from .calibrate_experts import ep_call_times, exchange_overheads
from .calibrate_layers import (LAYER_MODEL, MATMUL_SHAPES, best_of, call_overheads, fit_layers, layer_model_problem,
                               layer_timings, optimizer_bandwidth, tp_call_times, with_layers)
from .calibrate_links import collective_times, overlap_share
from .calibrate_profile import profile_yaml
from .calibrate_selective import selective_overhead
from .calibrate_units import unit_overheads, unit_step_times

__all__ = ["calibrate", "device_rates", "profile_yaml"]

# A GPU reaches its peak only on large products: a 1B-8B model's projections at 8192 tokens.
GPU_MATMUL_SHAPES = ((8192, 2048, 8192), (8192, 4096, 4096), (8192, 4096, 14336))
MESSAGE_BYTES = (4, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def device_rates(device, repeats: int = 10, dtypes: tuple[str, ...] | None = None, together=None) -> dict:
    """{"flops": {dtype: FLOP/s}, "memory_bandwidth": bytes/s} of one device: the median of three
    transformer-shaped matmuls per dtype, and a 128 MiB copy. `dtypes`: default float32 and
    bfloat16 on a GPU, float32 alone on a CPU (where `rewrite train` computes in float32 by default,
    and a profile's default dtype follows its fastest peak: `estimate.hardware.default_dtype`).
    `together`: as `best_of`'s."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"flops": {}}
    for dtype in (getattr(torch, d) for d in dtypes or (("float32", "bfloat16") if cuda else ("float32",))):
        rates = []
        for m, k, n in GPU_MATMUL_SHAPES if cuda else MATMUL_SHAPES:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            rates.append(2 * m * k * n / best_of(lambda: a @ b, repeats, sync=sync, together=together))
        out["flops"][str(dtype).removeprefix("torch.")] = statistics.median(rates)
    big = torch.empty(32 * 1024 * 1024, dtype=torch.float32, device=device)  # 128 MiB
    copy = torch.empty_like(big)
    out["memory_bandwidth"] = 2 * big.numel() * 4 / best_of(lambda: copy.copy_(big), repeats, sync=sync,
                                                           together=together)
    return out


def _measure(repeats: int, compiled: bool = True, model: str = LAYER_MODEL) -> dict:
    """On every rank at once: compute, memory, a layer's costs eager and (`compiled`) compiled, then collectives
    with the other ranks (rank 0 and 1 for p2p)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Every rank computes at once, as in a run: where ranks outnumber the cores, each gets its share of them.
    out = device_rates(device, repeats, together=dist.barrier)
    if not cuda:  # a layer's timings (fitted on every rank's at once: `fit_layers`), a step's end, and a tp layer's
        # collectives beyond their time alone (`Hardware.call_overhead_s`)
        out["layers"] = layer_timings(repeats, together=dist.barrier, model=model)
        out["optimizer_bandwidth"] = optimizer_bandwidth(repeats, together=dist.barrier)
        out["tp_calls"] = tp_call_times(repeats, together=dist.barrier)
        out["ep_calls"] = ep_call_times(repeats, together=dist.barrier)
        out["cp_gaps"] = context_layer_gaps(model, repeats, together=dist.barrier)
        out["unit_steps"] = unit_step_times(repeats, together=dist.barrier)
    if compiled and not cuda:
        out["compiled"] = layer_timings(repeats, together=dist.barrier, compiled=True, model=model)
    rank = dist.get_rank()
    p2p, reduce = {}, {}
    for size in MESSAGE_BYTES:
        buf = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=device)

        def ping():  # a round trip between ranks 0 and 1: two messages
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        dist.barrier()
        p2p[size] = best_of(ping, repeats, sync=sync) / 2
        dist.barrier()
        reduce[size] = best_of(lambda: dist.all_reduce(buf), repeats, sync=sync)
        lend(buf)
    out["p2p"], out["all_reduce"] = p2p, reduce
    out["collective_times"] = collective_times(device, 2 * repeats)  # medians of many: short calls, noisy
    out["overlap"] = overlap_share(device, repeats)
    if cuda:
        out["memory_bytes"] = torch.cuda.mem_get_info(device)[1]
    return out


def _fit(times: dict[int, float]) -> tuple[float, float]:
    """(latency, bandwidth) of `time = latency + bytes / bandwidth` through the smallest and largest message."""
    small, large = min(times), max(times)
    latency = times[small]
    return latency, (large - small) / max(times[large] - latency, 1e-12)


def calibrate(world: int = 2, *, repeats: int = 10, timeout_s: float = 300.0, compiled: bool = True,
              model: str | None = None) -> dict:
    """Measure this machine with `world` local ranks; the profile as a dict (`Hardware`'s fields) plus
    `measured`, the raw figures. `compiled`: measure a compiled layer's terms too (on CPU ranks; the first
    compile takes about half a minute, kept in the compile cache, `rewrite.compiled.compile_cache_dir`).
    `model`: fit the layer terms on this model's decoder layers (a preset, an HF config.json or model
    directory, at sizes this machine runs), so that its family's operators beyond the matmuls are priced as
    they run; None: the bench LLaMA's.

    Raises:
        ValueError: world < 2 (links need two ranks); a `model` that cannot be read or is too large to time.
    """
    from ..compiled import use_compile_cache
    from .launch import launch
    from .presets import load_config

    if world < 2:
        raise ValueError(f"--world {world}: calibrating the links needs at least 2 local ranks")
    model = model or LAYER_MODEL
    if problem := layer_model_problem(model):
        raise ValueError(problem)
    if compiled:
        use_compile_cache()  # the ranks inherit it: a second calibration reads the kernels back
    results = launch(_measure, world, repeats, compiled, model, timeout_s=timeout_s, echo=False)
    flops = {d: statistics.mean(r["flops"][d] for r in results) for d in results[0]["flops"]}
    bandwidth = statistics.mean(r["memory_bandwidth"] for r in results)
    latency, link = _fit(results[0]["p2p"])
    reduce = results[0]["all_reduce"]
    # A ring all-reduce moves 2 (n - 1) / n of the bytes per rank in 2 (n - 1) steps.
    steps, share = 2 * (world - 1), 2 * (world - 1) / world
    big = max(reduce)
    ideal = share * big / link
    efficiency = min(1.0, ideal / max(reduce[big] - steps * latency, 1e-12))
    memory = results[0].get("memory_bytes") or _host_memory() / world
    gpu = "memory_bytes" in results[0]
    # On a GPU the host queues kernels ahead of the device, so dispatch hides behind compute: not modelled.
    layers = ({"layer_overhead_s": 0.0, "activation_bandwidth": None, "microbatch_overhead_s": 0.0} if gpu else
              fit_layers([r["layers"]["times"] for r in results], flops["float32"], bandwidth, model))
    compiled_layers = ("compiled" in results[0] or None) and fit_layers(
        [r["compiled"]["times"] for r in results], flops["float32"], bandwidth, model)
    found = {
        "flops": flops, "memory_bandwidth": bandwidth, "latency": latency, "link": link, "collective": efficiency,
        "memory_gib": memory / 1024**3, "world": world, **layers, "gpu": gpu, "layer_model": model,
        "cores": None if gpu else _cores(),
        "optimizer_bandwidth": statistics.mean(r["optimizer_bandwidth"] for r in results) if not gpu else None,
        "collective_times": results[0]["collective_times"], "overlap": statistics.mean(r["overlap"] for r in results),
        "compiled": compiled_layers and {k: v for k, v in compiled_layers.items() if k != "layer_times"},
        "measured": {"p2p": results[0]["p2p"], "all_reduce": reduce, "layer_s": layers.pop("layer_times", None),
                     "compiled_layer_s": compiled_layers and compiled_layers["layer_times"]},
    }
    if results[0].get("tp_calls"):  # each rank's figures, priced on the profile measured above; their mean
        per_rank = [call_overheads(_profile(found), r["tp_calls"]) for r in results]
        found["call_overhead_s"] = {kind: statistics.mean(r[kind] for r in per_rank) for kind in per_rank[0]}
        found["measured"]["tp_calls"] = results[0]["tp_calls"]
    if results[0].get("ep_calls"):  # the experts' all-to-alls, over dp ranks and over a tp pair
        per_rank = [exchange_overheads(_profile(found), r["ep_calls"]) for r in results]
        found["call_overhead_s"].update({kind: statistics.mean(r[kind] for r in per_rank) for kind in per_rank[0]})
        found["measured"]["ep_calls"] = {kind: {way: t[way] for way in ("real", "free")}
                                         for kind, t in results[0]["ep_calls"].items()}
    if not gpu and "selective_layer_s" in results[0]["layers"]:  # selective checkpointing beyond the recompute
        hardware, three = _profile(found), with_layers(load_config(model), 3)
        selective = [r["layers"]["selective_layer_s"] for r in results]
        found["selective_overhead_s"] = statistics.mean(selective_overhead(hardware, three, s) for s in selective)
        found["measured"]["selective_layer_s"] = selective
    if results[0].get("cp_gaps"):  # cp's own work: each size's median over the pairs for each cp rank, the slower
        # of the two (a layer's exchange waits for it), priced once
        sides = [[r["cp_gaps"] for r in results[side::2]] for side in (0, 1)]
        gaps = {rows: max(statistics.median(g[rows] for g in side) for side in sides) for rows in results[0]["cp_gaps"]}
        work = context_work(_profile(found), with_layers(load_config(model), 3), gaps)
        found["context_work"], found["measured"]["cp_gaps"] = work, gaps
    if "unit_steps" in results[0]:  # FSDP2's own costs per unit, priced alike
        per_rank = [unit_overheads(_profile(found), r["unit_steps"], world) for r in results]
        found["unit_overhead_s"] = {kind: statistics.mean(r[kind] for r in per_rank) for kind in per_rank[0]}
        found["measured"]["unit_steps"] = results[0]["unit_steps"]
    return found


def _profile(found: dict):
    """The profile `found` describes, as `load_hardware` would read it."""
    import yaml

    from ..estimate.hardware import Hardware

    return Hardware.model_validate(yaml.safe_load(profile_yaml(found)))


def _cores() -> int:
    """The CPU cores this process may run on (what the ranks started here share)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _host_memory() -> float:
    """The host's memory in bytes (on Linux, /proc/meminfo's MemTotal)."""
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

