"""Seconds for a stage's work on a profile's device: FLOPs at the matmul rate, activations at the elementwise
operators' bandwidth and weights at the memory's (compute slower past the fitted microbatch sizes), and the tp,
cp and ep groups' collectives with their cost per call (`stage_time` sums them per layer)."""

from __future__ import annotations

from .collectives import collective_s
from .hardware import Hardware

__all__ = ["Clock"]


class Clock:
    """Seconds for FLOPs and bytes on the profile's device, and for the tp and cp groups' collectives. `traced`:
    the blocks are compiled, their collectives torch's functional ones (`tensor_parallel.comm.traced`), which
    run as torch's all_reduce, all_gather and reduce_scatter do."""

    def __init__(self, hardware: Hardware, dtype: str, tp: int, link, cp: int = 1, cp_link=None, ep: int = 1,
                 ep_link=None, traced: bool = False, tokens: int = 1) -> None:
        self.kinds = (("all_reduce", "all_gather", "reduce_scatter") if traced else ("sum", "gather", "scatter"))
        self.rate = hardware.flops(dtype) * hardware.efficiency.matmul
        self.bandwidth, self.tp, self.link = hardware.memory_bandwidth, tp, link
        self.act_bandwidth = hardware.activation_bandwidth or hardware.memory_bandwidth
        large = hardware.large_microbatch  # a microbatch of `tokens` a rank past the fitted sizes: compute slower
        self.scale = 1.0 if large is None else large.scale(tokens)
        self.cp, self.cp_link, self.ep, self.ep_link = cp, cp_link, ep, ep_link
        self.hardware = hardware
        self.overhead = hardware.layer_overhead_s / 3  # each of a layer's F, I and W
        self.selective = hardware.selective_overhead_s  # a layer checkpointed 'selective', in its I
        self.context = hardware.context_work if cp > 1 else None
        # Each eager tp collective's cost beside the layer's compute, beyond its time alone (none traced).
        calls = {} if traced else hardware.call_overhead_s
        self.call = {kind: calls.get(kind, 0.0) for kind in self.kinds}
        # An experts' exchange is eager in a compiled step too (its block split at it); beside a tp group's
        # collectives its ranks have met just before, alone they meet there.
        measured = hardware.call_overhead_s
        alone = measured.get("all_to_all", measured.get("sum", 0.0))
        self.ep_call = measured.get("all_to_all_tp", alone) if tp > 1 else alone

    def run(self, flops: float, activation_bytes: float, weight_bytes: float = 0.0) -> float:
        """FLOPs at the matmul rate, activations at the elementwise operators' bandwidth (both slower past the
        fitted microbatch sizes: `Hardware.large_microbatch`), weights at the memory's."""
        if self.act_bandwidth == self.bandwidth and self.scale == 1.0:  # one memory for both: one division
            return flops / self.rate + (activation_bytes + weight_bytes) / self.bandwidth
        return (flops / self.rate + activation_bytes / self.act_bandwidth) * self.scale + weight_bytes / self.bandwidth

    def _tp(self, kind: str, nbytes: float) -> float:
        return collective_s(self.hardware, kind, nbytes, self.tp, self.link) + self.call[kind]

    def all_reduce(self, nbytes: float) -> float:  # a sum of `nbytes` over the tp group
        return self._tp(self.kinds[0], nbytes) if self.tp > 1 and nbytes > 0 else 0.0

    def gather(self, nbytes: float) -> float:  # an all-gather or reduce-scatter of `nbytes` whole: their mean
        if self.tp <= 1 or nbytes <= 0:
            return 0.0
        return (self._tp(self.kinds[1], nbytes) + self._tp(self.kinds[2], nbytes)) / 2

    def cp_gather(self, nbytes: float) -> float:  # keys and values all-gathered over the cp group: a call each
        if self.cp <= 1:
            return 0.0
        return collective_s(self.hardware, self.kinds[1], nbytes, self.cp, self.cp_link) + 2 * self.call[self.kinds[1]]

    def cp_work(self, kv_bytes: float) -> float:  # a cp layer's own work gathering `kv_bytes`, F and I together
        return 0.0 if self.context is None else self.context.seconds(kv_bytes)

    def exchange(self, nbytes: float) -> float:  # an all-to-all of what one rank sends, over the ep group
        return collective_s(self.hardware, "all_to_all", nbytes, self.ep, self.ep_link) + self.ep_call
