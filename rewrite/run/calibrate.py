"""`rewrite calibrate`: measure this machine into a hardware profile (`rewrite.estimate.hardware`).

N local ranks (one torch thread each, as `rewrite train` runs them on CPU) measure at once:
matmul throughput at transformer shapes, memory bandwidth, a decoder layer's fixed cost (its
operators' dispatch, timed at tiny shapes), then point-to-point and all-reduce times between
them on the current backend; latency and bandwidth are fitted to the times.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from pathlib import Path

from ..lent import lend

__all__ = ["calibrate", "device_rates", "profile_yaml"]

# [tokens, hidden] x [hidden, 4 hidden]: an MLP projection at the bench model's sizes and above.
MATMUL_SHAPES = ((512, 256, 1024), (512, 512, 2048), (1024, 1024, 1024))
# A GPU reaches its peak only on large products: a 1B-8B model's projections at 8192 tokens.
GPU_MATMUL_SHAPES = ((8192, 2048, 8192), (8192, 4096, 4096), (8192, 4096, 14336))
MESSAGE_BYTES = (4, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def _best(fn, repeats: int, *, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)  # the best of the repeats: what the hardware can do, less this machine's noise


def device_rates(device, repeats: int = 10, dtypes: tuple[str, ...] | None = None) -> dict:
    """{"flops": {dtype: FLOP/s}, "memory_bandwidth": bytes/s} of one device: the median of three
    transformer-shaped matmuls per dtype, and a 128 MiB copy. `dtypes`: default float32 and
    bfloat16 on a GPU, float32 alone on a CPU (where `rewrite train` computes in float32 by default,
    and a profile's default dtype follows its fastest peak: `estimate.hardware.default_dtype`)."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"flops": {}}
    for dtype in (getattr(torch, d) for d in dtypes or (("float32", "bfloat16") if cuda else ("float32",))):
        rates = []
        for m, k, n in GPU_MATMUL_SHAPES if cuda else MATMUL_SHAPES:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            rates.append(2 * m * k * n / _best(lambda: a @ b, repeats, sync=sync))
        out["flops"][str(dtype).removeprefix("torch.")] = statistics.median(rates)
    big = torch.empty(32 * 1024 * 1024, dtype=torch.float32, device=device)  # 128 MiB
    copy = torch.empty_like(big)
    out["memory_bandwidth"] = 2 * big.numel() * 4 / _best(lambda: copy.copy_(big), repeats, sync=sync)
    return out


def _measure(repeats: int) -> dict:
    """On every rank at once: compute, memory, then collectives with the other ranks (rank 0 and 1 for p2p)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = device_rates(device, repeats)
    # On a GPU the host queues kernels ahead of the device, so dispatch hides behind compute: not modelled.
    out["layer_overhead_s"] = 0.0 if cuda else _layer_overhead(repeats)
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
        p2p[size] = _best(ping, repeats, sync=sync) / 2
        dist.barrier()
        reduce[size] = _best(lambda: dist.all_reduce(buf), repeats, sync=sync)
        lend(buf)
    out["p2p"], out["all_reduce"] = p2p, reduce
    if cuda:
        out["memory_bytes"] = torch.cuda.mem_get_info(device)[1]
    return out


def _layer_overhead(repeats: int) -> float:
    """Seconds a decoder layer's forward and backward take at shapes too small for their FLOPs to count:
    a tiny LLaMA of 3 layers against one of 1, on 8 tokens, halved."""
    import torch

    from .presets import build_config, build_model

    ids, times = torch.zeros(1, 8, dtype=torch.long), {}
    for layers in (1, 3):
        model = build_model(build_config("tiny-llama", num_hidden_layers=layers))
        times[layers] = _best(lambda: model(input_ids=ids).logits.sum().backward(), repeats)
    return max((times[3] - times[1]) / 2, 0.0)


def _fit(times: dict[int, float]) -> tuple[float, float]:
    """(latency, bandwidth) of `time = latency + bytes / bandwidth` through the smallest and largest message."""
    small, large = min(times), max(times)
    latency = times[small]
    return latency, (large - small) / max(times[large] - latency, 1e-12)


def calibrate(world: int = 2, *, repeats: int = 10, timeout_s: float = 300.0) -> dict:
    """Measure this machine with `world` local ranks; the profile as a dict (`Hardware`'s fields) plus
    `measured`, the raw figures.

    Raises:
        ValueError: world < 2 (links need two ranks).
    """
    from .launch import launch

    if world < 2:
        raise ValueError(f"--world {world}: calibrating the links needs at least 2 local ranks")
    results = launch(_measure, world, repeats, timeout_s=timeout_s, echo=False)
    flops = {d: statistics.mean(r["flops"][d] for r in results) for d in results[0]["flops"]}
    bandwidth = statistics.mean(r["memory_bandwidth"] for r in results)
    latency, link = _fit(results[0]["p2p"])
    reduce = results[0]["all_reduce"]
    # A ring all-reduce moves 2 (n - 1) / n of the bytes per rank in 2 (n - 1) steps.
    steps, share = 2 * (world - 1), 2 * (world - 1) / world
    big = max(reduce)
    ideal = share * big / link
    efficiency = min(1.0, ideal / max(reduce[big] - steps * latency, 1e-12))
    overhead = statistics.mean(r["layer_overhead_s"] for r in results)
    memory = results[0].get("memory_bytes") or _host_memory() / world
    return {
        "flops": flops, "memory_bandwidth": bandwidth, "latency": latency, "link": link, "collective": efficiency,
        "memory_gib": memory / 1024**3, "world": world, "layer_overhead_s": overhead,
        "measured": {"p2p": results[0]["p2p"], "all_reduce": reduce},
    }


def _host_memory() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def profile_yaml(found: dict, *, name: str = "calibrated") -> str:
    """The measured profile as a commented YAML file that `load_hardware` reads."""
    world, when = found["world"], datetime.date.today().isoformat()
    flops = "\n".join(f"  {d}: {v:.4g}" for d, v in found["flops"].items())
    times = ", ".join(f"{b} B {t * 1e6:.0f} us" for b, t in found["measured"]["p2p"].items())
    reduce = ", ".join(f"{b} B {t * 1e6:.0f} us" for b, t in found["measured"]["all_reduce"].items())
    return f"""\
# Measured by `rewrite calibrate --world {world}` on {platform.node() or 'this machine'} ({platform.machine()}, \
{platform.processor() or platform.system()}), {when}:
# {world} local ranks at once, one torch thread each. Point-to-point one way: {times}.
# All-reduce over {world} ranks: {reduce}.
name: {name}
description: {world} local ranks of {platform.node() or 'this machine'}, measured by rewrite calibrate
memory_gib: {found['memory_gib']:.2f}           # this device's memory, or the host's shared by {world} ranks
peak_flops:                 # measured: median of {len(MATMUL_SHAPES)} transformer-shaped matmuls on each rank at once
{flops}
memory_bandwidth: {found['memory_bandwidth']:.4g}   # measured: a 128 MiB copy, bytes read + written per second
devices_per_node: {world}         # the ranks measured together
intra_node:                 # measured: point-to-point between ranks 0 and 1
  bandwidth: {found['link']:.4g}
  latency: {found['latency']:.4g}
inter_node:                 # not measured (one machine): the same as intra_node
  bandwidth: {found['link']:.4g}
  latency: {found['latency']:.4g}
layer_overhead_s: {found.get('layer_overhead_s', 0.0):.3g}   # measured: a tiny LLaMA's forward + backward on 8 tokens, 3 layers against 1
efficiency:
  matmul: 1.0               # the peak above is what the matmuls reached
  collective: {found['collective']:.3f}          # all-reduce of the largest message against a ring at the p2p bandwidth
"""
