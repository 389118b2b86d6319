"""A hardware profile corrected by measured steps (`rewrite plan --measure K`).

A predicted step is split in two: what it takes on a profile whose links cost nothing (`compute`: the
matmuls, the elementwise traffic, the fixed costs per layer and microbatch, AdamW) and the rest
(`communication`: tensor-, context-, expert- and data-parallel collectives and pipeline transfers
not hidden behind compute). Measured steps of a few plans then give one scale for each part, fitted
by least squares on the relative error (every plan counts alike, whatever its length); where the
plans do not tell the parts apart (their shares of communication alike, or a fit that would make a
part free), one scale for both. The profile is rescaled accordingly: its compute terms by the first
scale, the links the measured plans used by the second (with the tp collectives' cost per call).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import yaml

from .hardware import Hardware, Link

__all__ = ["Parts", "Scales", "prediction_parts", "fit_scales", "scaled_profile", "profile_text"]

_FREE = Link(bandwidth=1e30, latency=0.0)  # a link that costs nothing: what a step takes without communication
_LIMITS = (0.05, 20.0)  # a fitted scale outside these is the fit's noise, not the machine: one scale instead


@dataclass(frozen=True)
class Parts:
    """A plan's predicted step (seconds) and the part of it that is not communication."""

    predicted: float
    compute: float

    @property
    def communication(self) -> float:
        return max(self.predicted - self.compute, 0.0)


@dataclass(frozen=True)
class Scales:
    """Measured over predicted, for the compute and the communication parts; `how` says how they were found."""

    compute: float
    communication: float
    how: str

    def corrected(self, parts: Parts) -> float:
        """The step `parts` predicts, rescaled."""
        return self.compute * min(parts.compute, parts.predicted) + self.communication * parts.communication


def prediction_parts(resolved, model, hardware: Hardware, **options) -> Parts:
    """`predict_step(resolved, model, hardware, **options)` and the same on links that cost nothing."""
    from .step_time import predict_step

    free = hardware.model_copy(update={"intra_node": _FREE, "inter_node": _FREE, "collective_times": {},
                                       "call_overhead_s": {}, "unit_overhead_s": {}})
    return Parts(predict_step(resolved, model, hardware, **options).step_s,
                 predict_step(resolved, model, free, **options).step_s)


def fit_scales(parts: list[Parts], measured: list[float]) -> Scales:
    """The scales that bring `parts` closest to `measured` (seconds, one per plan), in relative terms.

    Minimises sum((a * compute + b * communication) / measured - 1)^2 over a, b > 0; one scale for both
    when the plans' compute and communication move together, or a or b would leave (0.05, 20).

    Raises:
        ValueError: no plans, lengths that differ, or a measured time that is not positive.

    Example:
        >>> fit_scales([Parts(2.0, 1.0), Parts(3.0, 1.0)], [3.0, 5.0])  # compute x 1, communication x 2
        Scales(compute=1.0, communication=2.0, how='fitted')
    """
    if not parts or len(parts) != len(measured):
        raise ValueError(f"fit_scales needs one measured time per plan, got {len(measured)} for {len(parts)} plans")
    if any(not m > 0 for m in measured):
        raise ValueError(f"measured step times must be positive, got {measured}")
    rows = [(p.compute / m, p.communication / m) for p, m in zip(parts, measured)]
    cc, dd = sum(c * c for c, _ in rows), sum(d * d for _, d in rows)
    cd, c1, d1 = sum(c * d for c, d in rows), sum(c for c, _ in rows), sum(d for _, d in rows)
    det = cc * dd - cd * cd
    reason = "one plan measured" if len(rows) < 2 else "the plans' shares of communication are alike"
    if len(rows) >= 2 and dd > 0 and det > 1e-3 * cc * dd:  # the two columns are not (nearly) parallel
        a, b = (c1 * dd - d1 * cd) / det, (d1 * cc - c1 * cd) / det
        if all(_LIMITS[0] < s < _LIMITS[1] for s in (a, b)):
            return Scales(_round(a), _round(b), "fitted")
        reason = f"a fit of {a:.3g} x compute and {b:.3g} x communication is out of bounds"
    totals = [c + d for c, d in rows]
    one = _round(sum(totals) / sum(t * t for t in totals))
    return Scales(one, one, f"one scale: {reason}")


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def scaled_profile(hardware: Hardware, scales: Scales, *, links: tuple[str, ...] = ("intra_node",)) -> Hardware:
    """`hardware` with its compute terms `scales.compute` times slower and the `links` named (`intra_node`,
    `inter_node`: those the measured plans used) `scales.communication` times slower.

    Compute: the matmul rate (efficiency.matmul, or the peak past an efficiency of 1), memory, activation and
    optimizer bandwidth, the fixed costs per layer, per selectively checkpointed layer and per microbatch (a
    compiled step's too), a context-parallel layer's own work. A link: its latency and bandwidth alike; the
    intra-node link, the collectives' measured times and cost per call too (measured on one node).
    """
    a, b = scales.compute, scales.communication
    matmul = hardware.efficiency.matmul / a
    peaks = dict(hardware.peak_flops)
    if matmul > 1:  # faster than the profile's peak: the peak moves, the efficiency stays a fraction
        peaks, matmul = {k: v * matmul for k, v in peaks.items()}, 1.0
    bandwidth = hardware.activation_bandwidth
    update = {
        "peak_flops": peaks, "efficiency": hardware.efficiency.model_copy(update={"matmul": matmul}),
        "memory_bandwidth": hardware.memory_bandwidth / a,
        "activation_bandwidth": None if bandwidth is None else bandwidth / a,
        "optimizer_bandwidth": None if hardware.optimizer_bandwidth is None else hardware.optimizer_bandwidth / a,
        "layer_overhead_s": hardware.layer_overhead_s * a, "microbatch_overhead_s": hardware.microbatch_overhead_s * a,
        "selective_overhead_s": hardware.selective_overhead_s * a,
    }
    if (work := hardware.context_work) is not None:  # cp's own work: compute
        update["context_work"] = work.model_copy(update={"layer_s": work.layer_s * a, "per_byte_s": work.per_byte_s * a})
    if hardware.compiled is not None:  # a compiled step's terms, rescaled alike
        terms = hardware.compiled
        update["compiled"] = terms.model_copy(update={
            "layer_overhead_s": terms.layer_overhead_s * a, "microbatch_overhead_s": terms.microbatch_overhead_s * a,
            "activation_bandwidth": None if terms.activation_bandwidth is None else terms.activation_bandwidth / a})
    for name in links:
        link = getattr(hardware, name)
        update[name] = Link(bandwidth=link.bandwidth / b, latency=link.latency * b)
    if "intra_node" in links:
        update["collective_times"] = {kind: {n: {size: t * b for size, t in curve.items()} for n, curve in by_n.items()}
                                      for kind, by_n in hardware.collective_times.items()}
        update["call_overhead_s"] = {kind: t * b for kind, t in hardware.call_overhead_s.items()}
        update["unit_overhead_s"] = {kind: t * b for kind, t in hardware.unit_overhead_s.items()}
    name = hardware.name if hardware.name.endswith("-measured") else f"{hardware.name}-measured"
    return Hardware.model_validate({**hardware.model_dump(), **{k: _plain(v) for k, v in update.items()}, "name": name})


def _plain(value):
    return value.model_dump() if hasattr(value, "model_dump") else value


def profile_text(hardware: Hardware, header: list[str]) -> str:
    """`hardware` as a profile file `load_hardware` reads, under `header` (comment lines, without '#')."""
    when = datetime.date.today().isoformat()
    lines = [f"# {line}" if line else "#" for line in [*header, f"Written {when}."]]
    body = yaml.safe_dump(hardware.model_dump(exclude_defaults=False), sort_keys=False)
    return "\n".join(lines) + "\n" + body
