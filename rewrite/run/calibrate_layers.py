"""What a decoder layer's forward and backward cost a microbatch beyond their FLOPs, eager or compiled, and a
microbatch beyond its layers: the terms `rewrite calibrate` fits from a small LLaMA timed at several sizes."""

from __future__ import annotations

import statistics
import time

__all__ = ["ROWS", "SEQUENCE", "best_of", "layer_costs", "layer_terms"]


def best_of(fn, repeats: int, *, sync=lambda: None, together=None) -> float:
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


SEQUENCE, ROWS = 128, (1, 2, 4, 8)  # a decoder layer is timed on 1-8 sequences of SEQUENCE tokens


def layer_costs(repeats: int, flop_rate: float, memory_bandwidth: float, together=None, compiled: bool = False) -> dict:
    """What a decoder layer's forward and backward cost beyond their FLOPs, and a microbatch beyond its layers;
    `compiled`: with the embedding, each layer and the head under torch.compile (inductor), as `compile` in a
    plan runs them (compiled at the first two sizes, not timed: see `rewrite.compiled`).

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
    if compiled:
        from ..binding.resolve import resolve
        from ..compiled import apply_compile

        for model in models.values():
            apply_compile(model, resolve({"compile": {}}, model))
    for rows in ROWS:
        ids = torch.zeros(rows, SEQUENCE, dtype=torch.long)
        for n, model in models.items():
            times[rows, n] = best_of(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward(), repeats,
                                     together=together)  # no KV cache: as a step runs the layers
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


def layer_terms(found: list[dict]) -> dict:
    """The ranks' layer costs (`layer_costs`) as one profile's terms: their means (the activation bandwidth
    None unless every rank resolved it)."""
    bandwidths = [r["activation_bandwidth"] for r in found if r["activation_bandwidth"]]
    return {"layer_overhead_s": statistics.mean(r["layer_overhead_s"] for r in found),
            "activation_bandwidth": statistics.mean(bandwidths) if len(bandwidths) == len(found) else None,
            "microbatch_overhead_s": statistics.mean(r["microbatch_overhead_s"] for r in found)}


