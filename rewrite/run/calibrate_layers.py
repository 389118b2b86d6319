"""What a decoder layer's forward and backward cost a microbatch beyond their FLOPs, eager or compiled, a
microbatch beyond its layers, a tensor-parallel layer's collectives beyond their time alone, and a step's end
(the gradients' norm and AdamW): the terms `rewrite calibrate` fits from a small LLaMA timed at several sizes."""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

__all__ = ["LAYER_MODEL", "MATMUL_SHAPES", "ROWS", "SEQUENCE", "best_of", "call_overheads", "fit_layers",
           "made_and_free", "layer_model_problem", "layer_timings", "optimizer_bandwidth", "taking_turns", "tp_call_times", "with_layers"]


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


def taking_turns(calls: dict, repeats: int, together=None) -> dict:
    """{key: seconds} of each of `calls` ({key: fn}), timed `repeats` times taking turns (each round calls every
    one once, after a first round untimed), so that a slower or faster spell of the machine falls on all of them
    alike rather than on the ones timed then: the least of each key's times, or with `together` (as `best_of`'s)
    the median."""
    times: dict = {key: [] for key in calls}
    for i in range(repeats + 1):
        for key, fn in calls.items():
            if together is not None:
                together()
            start = time.perf_counter()
            fn()
            if i:
                times[key].append(time.perf_counter() - start)
    return {key: (min(t) if together is None else statistics.median(t)) for key, t in times.items()}


# [tokens, hidden] x [hidden, 4 hidden]: an MLP projection at the bench model's sizes and above (`device_rates`).
MATMUL_SHAPES = ((512, 256, 1024), (512, 512, 2048), (1024, 1024, 1024))
SEQUENCE, ROWS = 128, (1, 2, 4, 8)  # a decoder layer is timed on 1-8 sequences of SEQUENCE tokens
LARGE_ROWS = 16  # and eagerly on this many, where its activations outgrow a CPU's caches (`large_microbatch`)
LAYER_MODEL = "bench-llama"  # whose decoder layers the layer terms are fitted on, unless told (`calibrate --model`)
LAYER_LIMIT = 30_000_000  # parameters a decoder layer may hold to be timed here (the bench's hold 0.8-2.1 M)


def with_layers(config, n: int):
    """A copy of the transformers `config` with `n` decoder layers (its per-layer types cut to them)."""
    import copy

    out = copy.deepcopy(config)
    out.num_hidden_layers = n
    if isinstance(getattr(out, "layer_types", None), list):
        out.layer_types = out.layer_types[:n]
    return out


def layer_model_problem(model: str) -> str | None:
    """Why `model`'s decoder layers cannot be timed for the layer terms (`calibrate --model`), or None."""
    from .presets import build_model, load_config

    try:
        config = load_config(model)
    except ValueError as exc:  # names no model: the message says what would
        return str(exc)
    try:
        one, three = (build_model(with_layers(config, n), device="meta") for n in (1, 3))
    except (ValueError, TypeError, KeyError) as exc:  # a config transformers cannot build
        return f"`model={model}`: transformers cannot build it with 1 and 3 layers: {exc}"
    layer = (sum(p.numel() for p in three.parameters()) - sum(p.numel() for p in one.parameters())) // 2
    if layer > LAYER_LIMIT:
        return (f"`model={model}`: a decoder layer of {layer / 1e6:.0f} M parameters is too large to time here (at most "
                f"{LAYER_LIMIT / 1e6:.0f} M); give a config of the same family at smaller sizes (hidden 256-1024), or "
                f"none for {LAYER_MODEL}")
    return None


def layer_timings(repeats: int, together=None, compiled: bool = False, model: str = LAYER_MODEL) -> dict:
    """{"times": {(rows, layers): seconds}}: `model` (a preset, an HF config.json or model directory:
    `presets.load_config`) with 3 layers and with 1, by default a LLaMA of the bench model's proportions (hidden 256,
    intermediate 688), each running forward and backward on ROWS sequences of SEQUENCE tokens (128 to 1,024 tokens
    a microbatch) and, eagerly, on LARGE_ROWS, where its activations outgrow a CPU's caches; all timed taking turns
    (`taking_turns`). `compiled`: with the embedding, each layer and the head under torch.compile (inductor), as
    `compile` in a plan runs them (compiled at the first two sizes, in the untimed round: see `rewrite.compiled`).
    Eagerly, also "selective_layer_s": the 3 layers checkpointed 'selective' against not on one sequence
    (`calibrate_selective`), where the estimate prices it."""
    import torch

    from ..binding.resolve import resolve
    from .presets import build_model, load_config

    models = {n: build_model(with_layers(load_config(model), n)) for n in (1, 3)}
    if compiled:
        from ..compiled import apply_compile

        for built in models.values():
            apply_compile(built, resolve({"compile": {}}, built))

    def step(built, rows: int):  # no KV cache: as a step runs the layers
        ids = torch.zeros(rows, SEQUENCE, dtype=torch.long)
        return lambda: built(input_ids=ids, use_cache=False).logits.sum().backward()

    out = {"times": taking_turns({(rows, n): step(built, rows) for rows in ROWS + (() if compiled else (LARGE_ROWS,))
                                  for n, built in models.items()}, repeats, together)}
    from ..estimate.plan_parts import selective_problem
    from .calibrate_selective import selective_layer_time

    if not compiled and selective_problem(models[3]) is None:  # a family the estimate prices 'selective' for
        out["selective_layer_s"] = selective_layer_time(models[3], repeats, together)
    return out


def fit_layers(timings: list[dict], flop_rate: float, memory_bandwidth: float, model: str = LAYER_MODEL) -> dict:
    """What a decoder layer's forward and backward cost beyond their FLOPs, and a microbatch beyond its layers,
    from one or more processes' `layer_timings` ("times"), each size's median across them (ranks timed at once).

    A layer's time (3 layers' less 1's, halved), fitted by least squares over ROWS, is a fixed part
    (`layer_overhead_s`: operator dispatch, at least 0) plus a part per token. Of the part per token, the layer's
    FLOPs at `flop_rate` take what the step-time model charges them; the rest is its elementwise operators (norms,
    rotary, SiLU, residual adds and their backwards) moving the activations the model counts (`layer_bytes`:
    written in F and I, read in I), at `activation_bandwidth` (None where the FLOPs leave no time, or it would
    pass a large copy's `memory_bandwidth`: the fit cannot tell). What the 1-layer model takes beyond its layer on
    one sequence, less its head's FLOPs, is the cost of a microbatch's forward and backward calls outside their
    layers (`microbatch_overhead_s`: embedding, final norm, head, loss, the autograd engine's start). Where
    LARGE_ROWS was timed, the 3-layer model's time per token there over that on the largest of ROWS
    (`large_microbatch`). `layer_times`: {tokens: a layer's seconds}, as fitted."""
    from ..estimate.layer_activations import Sizes, layer_bytes
    from ..models.flops import head_flops, layer_flops
    from .presets import build_model, load_config

    times = {key: statistics.median(t[key] for t in timings) for key in timings[0]}
    config = build_model(with_layers(load_config(model), 1), device="meta").config
    tokens = [rows * SEQUENCE for rows in ROWS]
    layer = [(times[rows, 3] - times[rows, 1]) / 2 for rows in ROWS]
    fixed, per_token = _line(tokens, layer)
    fixed = max(fixed, 0.0)

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
    out = {"layer_overhead_s": fixed, "activation_bandwidth": bandwidth, "microbatch_overhead_s": outside,
           "layer_times": dict(zip(tokens, layer))}
    if (LARGE_ROWS, 3) in times:  # twice the largest fitted microbatch: the 3-layer model's time per token there
        out["layer_times"][LARGE_ROWS * SEQUENCE] = (times[LARGE_ROWS, 3] - times[LARGE_ROWS, 1]) / 2
        out["large_microbatch"] = {"tokens": tokens[-1], "ratio": times[LARGE_ROWS, 3] * ROWS[-1] / (
            times[ROWS[-1], 3] * LARGE_ROWS)}
    return out


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


OPTIMIZER_LAYERS = 12  # the decoder layers whose parameters a step's end updates: ~8.7 M elements, past a CPU's caches


def optimizer_bandwidth(repeats: int, together=None) -> float:
    """Bytes per second of a step's end over the traffic the step-time model counts for it (`ADAMW_TRAFFIC` + 3 x 4
    bytes per float32 element: `Hardware.optimizer_bandwidth`): the gradients' norm clipped a tensor at a time, as
    `clip_grad_norm_` does, then torch's AdamW step (its default implementation for CPU tensors: an operator at a
    time, each reading and writing whole tensors), on the parameters of OPTIMIZER_LAYERS decoder layers of the
    bench model's shapes (hidden 256, intermediate 688). Measured on CPU ranks at about 3-4x a large copy's time
    for the counted bytes."""
    import torch

    from ..estimate.dp_time import ADAMW_TRAFFIC
    from .presets import build_config, build_model

    layers = build_model(build_config("bench-llama", num_hidden_layers=OPTIMIZER_LAYERS)).model.layers
    params = list(layers.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def end() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
        optimizer.step()

    elements = sum(p.numel() for p in params)
    return elements * (3 * 4 + ADAMW_TRAFFIC) / best_of(end, repeats, together=together)


_TP_KINDS = {"sum": False, "gather": True}  # the collectives a tp 2 layer calls -> sequence parallelism
TP_LAYERS, TP_SHAPE = 4, (4, 4)  # the tp models timed: 4 layers; 4 microbatches of 4 sequences of SEQUENCE tokens


def _tp_plan(sequence_parallel: bool) -> dict:
    from ..models.blocks import ATTENTION, MLP

    rules = {f"model.layers.*.{block.layer_part}.{name}": "column" for block in (ATTENTION, MLP) for name in block.inputs}
    rules.update({f"model.layers.*.{block.layer_part}.{block.output}": "row" for block in (ATTENTION, MLP)})
    return {"mesh": {"tp": 2}, "tensor_parallel": rules, "sequence_parallel": sequence_parallel}


def tp_call_times(repeats: int, together=None) -> dict[str, dict]:
    """What a tp 2 model's collectives cost inside its forwards and backwards: {kind: {"real": s, "free": s,
    "swaps": [bytes, ...]}} for a plain model (its collectives `sum`) and a sequence-parallel one (`gather`,
    `scatter`), each timed with its collectives made and without (`tensor_parallel.comm.loopback`: the same
    products, each rank alone), taking turns, the median of each; `swaps`: the pairwise swaps made. Every pair of
    ranks (0-1, 2-3, ...) runs at once, as a run's tp groups do; {} for an odd world. Collective: every rank of the
    default group calls it."""
    import torch
    import torch.distributed as dist

    from ..binding.resolve import resolve
    from ..tensor_parallel.apply import apply_tensor_parallel
    from .presets import build_config, build_model

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % 2:
        return {}
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group, out = pairs[rank // 2], {}
    microbatches, rows = TP_SHAPE
    ids = torch.zeros(rows, SEQUENCE, dtype=torch.long)
    for kind, sequence_parallel in _TP_KINDS.items():
        model = build_model(build_config("bench-llama", num_hidden_layers=TP_LAYERS))
        apply_tensor_parallel(model, resolve(_tp_plan(sequence_parallel), model, world_size=2), group)

        out[kind] = made_and_free(model, ids, microbatches, repeats, together)
    dist.destroy_process_group(group)  # its threads (gone with the models) would slow what calibrate measures next
    return out


def made_and_free(model, ids, microbatches: int, repeats: int, together=None, swaps_too: bool = True) -> dict:
    """{"real": s, "free": s, "swaps": [bytes, ...]}: `microbatches` forwards and backwards of `model` on `ids`
    with its collectives made and without (`tensor_parallel.comm.loopback`; `swaps_too` False: its all-to-alls
    alone), taking turns, the median of each (the first round warms up, untimed); `swaps`: the bytes of each
    exchange a step makes that is looped back."""
    from ..tensor_parallel.comm import loopback

    def step():
        for _ in range(microbatches):
            model(input_ids=ids, use_cache=False).logits.sum().backward()

    times: dict = {"real": [], "free": []}
    for i in range(max(repeats // 2, 2) + 1):
        for way, made in times.items():
            (together or (lambda: None))()
            start = time.perf_counter()
            with nullcontext([]) if way == "real" else loopback(swaps_too) as swaps:
                step()
            if i:
                made.append(time.perf_counter() - start)
    return {way: statistics.median(t) for way, t in times.items()} | {"swaps": swaps}


def call_overheads(hardware, times: dict[str, dict]) -> dict[str, float]:
    """The profile's `call_overhead_s` from `tp_call_times`: per kind, the time the collectives took inside the
    layers (made against not made) beyond their time alone (each swap priced as `hardware` prices a 2-rank `sum`
    of its bytes), per swap; never below 0. The sequence-parallel figure serves gathers and reduce-scatters alike."""
    from ..estimate.collectives import collective_s

    out = {}
    for kind, found in times.items():
        alone = sum(collective_s(hardware, "sum", nbytes, 2, hardware.intra_node) for nbytes in found["swaps"])
        out[kind] = max((found["real"] - found["free"] - alone) / max(len(found["swaps"]), 1), 0.0)
    if "gather" in out:
        out["scatter"] = out["gather"]
    return out
