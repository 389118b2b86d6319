"""`rewrite calibrate`: measure this machine into a hardware profile (`rewrite.estimate.hardware`).

N local ranks (one torch thread each, as `rewrite train` runs them on CPU) measure at once:
matmul throughput at transformer shapes, memory bandwidth, a decoder layer's fixed cost and its
elementwise operators' bandwidth (a layer timed at two token counts), a microbatch's cost outside
its layers, then point-to-point and all-reduce times between them on the current backend (latency
and bandwidth are fitted to the times), and each collective a run makes by size and group
(`calibrate_links`).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from pathlib import Path

from ..lent import lend
from .calibrate_links import collective_lines, collective_times, overlap_share

__all__ = ["calibrate", "device_rates", "profile_yaml"]

# [tokens, hidden] x [hidden, 4 hidden]: an MLP projection at the bench model's sizes and above.
MATMUL_SHAPES = ((512, 256, 1024), (512, 512, 2048), (1024, 1024, 1024))
# A GPU reaches its peak only on large products: a 1B-8B model's projections at 8192 tokens.
GPU_MATMUL_SHAPES = ((8192, 2048, 8192), (8192, 4096, 4096), (8192, 4096, 14336))
MESSAGE_BYTES = (4, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def _best(fn, repeats: int, *, sync=lambda: None, together=None) -> float:
    """The least of `repeats` timings of `fn` (what the hardware can do, less this machine's noise). `together`:
    called before each (a barrier), so that every rank computes at once, sharing the cores as a run does; then
    the median, which a rank that happened to run alone for a moment does not set."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        if together is not None:
            together()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times) if together is None else statistics.median(times)


def device_rates(device, repeats: int = 10, dtypes: tuple[str, ...] | None = None, together=None) -> dict:
    """{"flops": {dtype: FLOP/s}, "memory_bandwidth": bytes/s} of one device: the median of three
    transformer-shaped matmuls per dtype, and a 128 MiB copy. `dtypes`: default float32 and
    bfloat16 on a GPU, float32 alone on a CPU (where `rewrite train` computes in float32 by default,
    and a profile's default dtype follows its fastest peak: `estimate.hardware.default_dtype`).
    `together`: as `_best`'s."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"flops": {}}
    for dtype in (getattr(torch, d) for d in dtypes or (("float32", "bfloat16") if cuda else ("float32",))):
        rates = []
        for m, k, n in GPU_MATMUL_SHAPES if cuda else MATMUL_SHAPES:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            rates.append(2 * m * k * n / _best(lambda: a @ b, repeats, sync=sync, together=together))
        out["flops"][str(dtype).removeprefix("torch.")] = statistics.median(rates)
    big = torch.empty(32 * 1024 * 1024, dtype=torch.float32, device=device)  # 128 MiB
    copy = torch.empty_like(big)
    out["memory_bandwidth"] = 2 * big.numel() * 4 / _best(lambda: copy.copy_(big), repeats, sync=sync,
                                                           together=together)
    return out


def _measure(repeats: int) -> dict:
    """On every rank at once: compute, memory, then collectives with the other ranks (rank 0 and 1 for p2p)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Every rank computes at once, as in a run: where ranks outnumber the cores, each gets its share of them.
    out = device_rates(device, repeats, together=dist.barrier)
    # On a GPU the host queues kernels ahead of the device, so dispatch hides behind compute: not modelled.
    out.update({"layer_overhead_s": 0.0, "activation_bandwidth": None, "microbatch_overhead_s": 0.0} if cuda
               else _layer_costs(repeats, out["flops"]["float32"], out["memory_bandwidth"], together=dist.barrier))
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
    out["collective_times"] = collective_times(device, 2 * repeats)  # medians of many: short calls, noisy
    out["overlap"] = overlap_share(device, repeats)
    if cuda:
        out["memory_bytes"] = torch.cuda.mem_get_info(device)[1]
    return out


SEQUENCE, ROWS = 128, (1, 2, 4, 8)  # a decoder layer is timed on 1-8 sequences of SEQUENCE tokens


def _layer_costs(repeats: int, flop_rate: float, memory_bandwidth: float, together=None) -> dict:
    """What a decoder layer's forward and backward cost beyond their FLOPs, and a microbatch beyond its layers.

    A LLaMA of the bench model's proportions (hidden 256, intermediate 688) with 3 layers against 1, each on
    ROWS sequences of SEQUENCE tokens (128 to 1,024 tokens a microbatch): a layer's time, fitted by least
    squares, is a fixed part (`layer_overhead_s`: operator dispatch) plus a part per token. Of the part per
    token, the layer's FLOPs at `flop_rate` take what the step-time model charges them; the rest is its
    elementwise operators (norms, rotary, SiLU, residual adds and their backwards) moving the activations
    the model counts (`layer_bytes`: written in F and I, read in I), at `activation_bandwidth` (None where
    the FLOPs leave no time, or it would pass a large copy's `memory_bandwidth`: the fit cannot tell). What the
    1-layer model takes beyond its layer on one sequence, less its head's FLOPs, is the cost of a
    microbatch's forward and backward calls outside their layers (`microbatch_overhead_s`: embedding, final
    norm, head, loss, the autograd engine's start).
    """
    import torch

    from ..estimate.layer_activations import Sizes, layer_bytes
    from ..models.flops import head_flops, layer_flops
    from .presets import build_config, build_model

    times = {}
    models = {n: build_model(build_config("bench-llama", num_hidden_layers=n)) for n in (1, 3)}
    for rows in ROWS:
        ids = torch.zeros(rows, SEQUENCE, dtype=torch.long)
        for n, model in models.items():
            times[rows, n] = _best(lambda: model(input_ids=ids).logits.sum().backward(), repeats, together=together)
    config = models[1].config
    tokens = [rows * SEQUENCE for rows in ROWS]
    layer = [(times[rows, 3] - times[rows, 1]) / 2 for rows in ROWS]
    mean_t, mean_l = statistics.mean(tokens), statistics.mean(layer)
    per_token = (sum((t - mean_t) * (y - mean_l) for t, y in zip(tokens, layer))
                 / sum((t - mean_t) ** 2 for t in tokens))
    fixed = max(mean_l - per_token * mean_t, 0.0)

    def counted(rows: int) -> tuple[float, float]:  # (FLOPs of F + I + W, activation bytes moved) of a layer
        kept, _ = layer_bytes(Sizes.of(config, seq_len=SEQUENCE, batch_size=rows), attention_split=False,
                              mlp_split=False, shared_split=False)
        return 3 * rows * layer_flops(config, seq_len=SEQUENCE), 5 * kept

    (flops_one, bytes_one), (flops_two, bytes_two) = counted(1), counted(2)  # both linear in the rows
    moving = per_token - (flops_two - flops_one) / SEQUENCE / flop_rate  # seconds per token beyond FLOPs
    bandwidth = (bytes_two - bytes_one) / SEQUENCE / moving if moving > 0 else None
    if bandwidth is not None and bandwidth >= memory_bandwidth:  # no faster than a large copy: not resolved
        bandwidth = None
    head = 3 * head_flops(config, seq_len=SEQUENCE) / flop_rate
    outside = max(times[1, 1] - (fixed + per_token * SEQUENCE) - head, 0.0)
    return {"layer_overhead_s": fixed, "activation_bandwidth": bandwidth, "microbatch_overhead_s": outside,
            "layer_times": dict(zip(tokens, layer))}


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
    found = [r["activation_bandwidth"] for r in results if r["activation_bandwidth"]]
    activation = statistics.mean(found) if len(found) == len(results) else None
    outside = statistics.mean(r["microbatch_overhead_s"] for r in results)
    memory = results[0].get("memory_bytes") or _host_memory() / world
    return {
        "flops": flops, "memory_bandwidth": bandwidth, "latency": latency, "link": link, "collective": efficiency,
        "memory_gib": memory / 1024**3, "world": world, "layer_overhead_s": overhead,
        "activation_bandwidth": activation, "microbatch_overhead_s": outside, "gpu": "memory_bytes" in results[0],
        "collective_times": results[0]["collective_times"], "overlap": statistics.mean(r["overlap"] for r in results),
        "measured": {"p2p": results[0]["p2p"], "all_reduce": reduce, "layer_s": results[0].get("layer_times")},
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


def _reserve_lines(found: dict) -> str:
    if found.get("gpu"):
        return ("memory_reserve_gib: 3.0     # not measured: the CUDA context and NCCL's buffers, as the shipped GPU profiles\n"
                "fragmentation: 0.05         # not measured: the caching allocator's share, as the shipped GPU profiles")
    return ("memory_reserve_gib: 0.0     # none kept: memory_gib is already the host's memory shared out between the ranks\n"
            "fragmentation: 0.0          # not modelled: the CPU allocator returns freed memory to the host")


def _activation_line(found: dict) -> str:
    bandwidth = found.get("activation_bandwidth")
    if not bandwidth:
        return "activation_bandwidth: null   # measured: a layer's FLOPs explain its time per token; memory_bandwidth is used"
    return (f"activation_bandwidth: {bandwidth:.4g}   # measured: a layer's time per token beyond its FLOPs, over the "
            "activation bytes the model counts")


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
layer_overhead_s: {found.get('layer_overhead_s', 0.0):.3g}   # measured: a decoder layer's forward + backward, its fixed part (3 layers against 1 on {ROWS[0]}-{ROWS[-1]} sequences of {SEQUENCE} tokens, fitted)
{_activation_line(found)}
microbatch_overhead_s: {found.get('microbatch_overhead_s', 0.0):.3g}   # measured: a 1-layer model's forward + backward on one sequence of {SEQUENCE} tokens beyond its layer and head FLOPs
{_reserve_lines(found)}
{collective_lines(found.get("collective_times", {}))}
overlap: {found.get("overlap", 1.0):.2f}               # {"measured: a reduce-scatter beside as long a run of matmuls, against each alone" if "overlap" in found else "not measured: collectives beside compute hide behind it"}
efficiency:
  matmul: 1.0               # the peak above is what the matmuls reached
  collective: {found['collective']:.3f}          # all-reduce of the largest message against a ring at the p2p bandwidth
"""
