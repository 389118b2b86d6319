"""What checkpointing a decoder layer 'selective' costs beyond the work its recompute repeats (torch's policy
consulted on each operator: `Hardware.selective_overhead_s`), as `rewrite calibrate` measures it."""

from __future__ import annotations

import statistics
import time

from .calibrate_layers import SEQUENCE

__all__ = ["selective_layer_time", "selective_overhead"]


def selective_layer_time(model, repeats: int, together=None) -> float:
    """What checkpointing 'selective' adds to a decoder layer's forward and backward on one sequence: `model` (3
    layers) against a copy of it with every layer checkpointed so, taking turns, the median of the paired
    differences over at least 24 pairs, per layer. Measured at one size (the one where the policy's cost per
    operator is the largest share) and many times: a fit over sizes cannot separate it from the noise."""
    import torch

    from ..binding.resolve import resolve
    from ..rewriter import apply_activation_checkpointing
    from .presets import build_model

    config = model.config
    checkpointed = build_model(config)
    layers = resolve({}, checkpointed).backbone.layers
    apply_activation_checkpointing(checkpointed, resolve({"activation_checkpointing": {f"{layers}.*": "selective"}},
                                                         checkpointed))
    ids = torch.zeros(1, SEQUENCE, dtype=torch.long)
    pair = []
    for m in (model, checkpointed):
        def run(m=m):
            (together or (lambda: None))()
            start = time.perf_counter()
            m(input_ids=ids, use_cache=False).logits.sum().backward()
            return time.perf_counter() - start
        pair.append(run)
    for run in pair:  # warm both
        run()
    gaps = [pair[1]() - pair[0]() for _ in range(max(4 * repeats, 24))]
    return statistics.median(gaps) / config.num_hidden_layers


def selective_overhead(hardware, config, extra: float) -> float:
    """The profile's `selective_overhead_s` from `selective_layer_time`'s `extra` on `config`'s layers: beyond what
    `hardware` (its other terms) charges a layer checkpointed 'selective' on one sequence of SEQUENCE tokens (the
    recompute's work: `stage_time`), never below 0."""
    from ..binding.resolve import resolve
    from ..estimate.memory import with_run
    from ..estimate.stage_time import stage_times
    from .presets import build_model

    model = build_model(config, device="meta")
    layers = resolve({}, model).backbone.layers
    charged = []
    for plan in ({}, {"activation_checkpointing": {f"{layers}.*": "selective"}}):
        run = with_run(resolve(plan, model), seq_len=SEQUENCE)
        charged.append(stage_times(run, model, hardware.model_copy(update={"selective_overhead_s": 0.0}))[0])
    return max(extra - (charged[1].input_backward - charged[0].input_backward) / config.num_hidden_layers, 0.0)

