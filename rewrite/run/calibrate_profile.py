"""The hardware profile `rewrite calibrate` writes: its measurements as a commented YAML file that
`load_hardware` reads, each line saying what set it."""

from __future__ import annotations

import datetime
import platform

from .calibrate_cp import CP_ROWS
from .calibrate_layers import LARGE_ROWS, LAYER_MODEL, MATMUL_SHAPES, OPTIMIZER_LAYERS, ROWS, SEQUENCE
from .calibrate_links import collective_lines
from .calibrate_units import UNIT_LAYERS, UNIT_MICROBATCHES

__all__ = ["profile_yaml"]


def _reserve_lines(found: dict) -> str:
    if found.get("gpu"):
        return ("memory_reserve_gib: 3.0     # not measured: the CUDA context and NCCL's buffers, as the shipped GPU profiles\n"
                "fragmentation: 0.05         # not measured: the caching allocator's share, as the shipped GPU profiles")
    return ("memory_reserve_gib: 0.0     # none kept: memory_gib is already the host's memory shared out between the ranks\n"
            "fragmentation: 0.0          # not modelled: the CPU allocator returns freed memory to the host")


def _layer_lines(found: dict) -> str:
    bandwidth, large = found.get("activation_bandwidth"), found.get("large_microbatch")
    return ((f"activation_bandwidth: {bandwidth:.4g}   # measured: a layer's time per token beyond its FLOPs, over the "
             "activation bytes the model counts" if bandwidth else "activation_bandwidth: null   # measured: a layer's "
             "FLOPs explain its time per token; memory_bandwidth is used") + "\n" + (
        f"large_microbatch: {{tokens: {large['tokens']}, ratio: {large['ratio']:.3g}}}   # measured: the 3-layer model's "
        f"time per token on {LARGE_ROWS * SEQUENCE} tokens over that on {large['tokens']}" if large else
        _unmeasured(found, "large_microbatch: null", "(no time per token to compare with)")) + "\n" + _selective_line(found))


def _selective_line(found: dict) -> str:
    if "selective_overhead_s" not in found:
        return _unmeasured(found, "selective_overhead_s: 0.0", "(its layers are not estimated under 'selective')")
    return (f"selective_overhead_s: {found['selective_overhead_s']:.3g}   # measured: the 3-layer model checkpointed "
            f"'selective' against not, on one sequence of {SEQUENCE} tokens, per layer, beyond the recompute charged")


def _unmeasured(found: dict, line: str, why: str, then: str = "") -> str:
    """The profile's `line` for a term calibrate did not measure: on a GPU, else `why`."""
    return f"{line:<29}# not measured {'on a GPU' if found.get('gpu') else why}{then}"


def _optimizer_line(found: dict) -> str:
    bandwidth = found.get("optimizer_bandwidth")
    if not bandwidth:
        return _unmeasured(found, "optimizer_bandwidth: null", "here", ": AdamW's traffic is charged at memory_bandwidth")
    return (f"optimizer_bandwidth: {bandwidth:.4g}   # measured: the gradients' norm clipped and AdamW's step on "
            f"{OPTIMIZER_LAYERS} bench layers' parameters, every rank at once, over the traffic counted")


def _compiled_lines(found: dict) -> str:
    terms = found.get("compiled")
    if not terms:
        return _unmeasured(found, "compiled: null", "(rewrite calibrate --no-compile)",
                           ": a compiled plan is charged the eager terms above")
    bandwidth = terms["activation_bandwidth"]
    return ("compiled:                   # measured: the same fit with the embedding, each layer and the head under "
            "torch.compile (inductor)\n"
            f"  layer_overhead_s: {terms['layer_overhead_s']:.3g}\n"
            f"  activation_bandwidth: {'null' if bandwidth is None else f'{bandwidth:.4g}'}\n"
            f"  microbatch_overhead_s: {terms['microbatch_overhead_s']:.3g}")


def _cores_line(found: dict) -> str:
    if not found.get("cores"):
        return "cores_per_node: null        # each rank computes on a device of its own"
    return (f"cores_per_node: {found['cores']}           # the CPU cores the ranks share (the compute terms were measured "
            f"with {found['world']} ranks busy at once)")


def _call_lines(found: dict) -> str:
    calls = found.get("call_overhead_s")
    if not calls:
        return _unmeasured(found, "call_overhead_s: {}", "(an odd number of ranks: no tp 2 groups)")
    return ("call_overhead_s:            # measured: a tp 2 model's collectives inside its layers (made against not "
            "made, every pair at once; all_to_all, all_to_all_tp: a MoE's, its experts over a dp pair, a tp pair) "
            "beyond their time alone, per call\n" + "\n".join(f"  {kind}: {t:.3g}" for kind, t in calls.items()))


def _context_lines(found: dict) -> str:
    work = found.get("context_work")
    if not work:
        return _unmeasured(found, "context_work: null", "(an odd number of ranks, or a family cp does not run)",
                           ": cp's own work is not charged")
    return ("context_work:               # measured: the 3-layer model under cp 2, its exchanges looped back, against "
            f"not, on the same {' and '.join(str(r * SEQUENCE) for r in CP_ROWS)} tokens a rank, per layer, beyond "
            f"what the terms above charge\n  layer_s: {work['layer_s']:.3g}\n  per_byte_s: {work['per_byte_s']:.3g}")


def _unit_lines(found: dict) -> str:
    calls = found.get("unit_overhead_s")
    if not calls:
        return _unmeasured(found, "unit_overhead_s: {}", "here", ": FSDP2's work per unit is not charged")
    return (f"unit_overhead_s:            # measured: a {UNIT_LAYERS}-layer bench model with dp over every rank, "
            f"replicate, grad_op and full at {' and '.join(map(str, UNIT_MICROBATCHES))} microbatches and FSDP2's "
            "replicate beside DDP, what FSDP2 adds beyond its collectives' time alone, per unit (optimizer: per "
            "parameter)\n" + "\n".join(f"  {kind}: {t:.3g}" for kind, t in calls.items()))


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
{_cores_line(found)}
intra_node:                 # measured: point-to-point between ranks 0 and 1
  bandwidth: {found['link']:.4g}
  latency: {found['latency']:.4g}
inter_node:                 # not measured (one machine): the same as intra_node
  bandwidth: {found['link']:.4g}
  latency: {found['latency']:.4g}
layer_overhead_s: {found.get('layer_overhead_s', 0.0):.3g}   # measured: a decoder layer's forward + backward, its fixed part ({found.get('layer_model', LAYER_MODEL)}: 3 layers against 1 on {ROWS[0]}-{ROWS[-1]} sequences of {SEQUENCE} tokens, fitted)
{_layer_lines(found)}
microbatch_overhead_s: {found.get('microbatch_overhead_s', 0.0):.3g}   # measured: a 1-layer model's forward + backward on one sequence of {SEQUENCE} tokens beyond its layer and head FLOPs
{_optimizer_line(found)}
{_reserve_lines(found)}
{collective_lines(found.get("collective_times", {}))}
{_call_lines(found)}
{_context_lines(found)}
{_unit_lines(found)}
{_compiled_lines(found)}
overlap: {found.get("overlap", 1.0):.2f}               # {"measured: a reduce-scatter beside as long a run of matmuls, against each alone" if "overlap" in found else "not measured: collectives beside compute hide behind it"}
efficiency:
  matmul: 1.0               # the peak above is what the matmuls reached
  collective: {found['collective']:.3g}          # all-reduce of the largest message against a ring at the p2p bandwidth
"""
