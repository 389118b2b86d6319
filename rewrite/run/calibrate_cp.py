"""What a context-parallel decoder layer computes beyond its FLOPs and its exchanges (`Hardware.context_work`), as
`rewrite calibrate` measures it: a cp 2 model with its exchanges looped back against a plain one on the same
tokens a rank, at two sizes."""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

from .calibrate_layers import SEQUENCE, with_layers

__all__ = ["CP_ROWS", "context_layer_gaps", "context_work"]

CP_ROWS = (1, 8)  # sequences of SEQUENCE tokens a rank holds (2x as many halves under cp 2): 128 to 1,024 tokens
_LAYERS = 3


def context_layer_gaps(model: str, repeats: int, together=None) -> dict[int, float]:
    """{rows: seconds} a decoder layer of `model` (a preset or HF config, `_LAYERS` layers) takes under cp 2 beyond
    the same layer without, forward and backward on `rows` x SEQUENCE tokens a rank (cp: 2 x rows sequences, each
    rank holding its half of each), the cp exchanges looped back (`tensor_parallel.comm.loopback`: the same work,
    no rank waiting for the other); the median of at least 12 paired differences, taking turns. Every pair of
    ranks (0-1, 2-3, ...) at once, as a run's cp groups; {} for an odd world or a family cp does not run.
    Collective: every rank of the default group calls it."""
    import torch
    import torch.distributed as dist

    from ..context_parallel.attention import NAME, register, sequence_shard
    from ..context_parallel.family import context_parallel_problem
    from ..context_parallel.shard import held
    from ..tensor_parallel.comm import loopback
    from .presets import build_model, load_config

    world, rank = dist.get_world_size(), dist.get_rank()
    plain, cp = (build_model(with_layers(load_config(model), _LAYERS)) for _ in range(2))  # a config each
    if world % 2 or context_parallel_problem(plain) is not None:
        return {}
    register()
    cp.set_attn_implementation(NAME)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    shard = sequence_shard(pairs[rank // 2], 2, rank % 2, SEQUENCE, device="cpu")
    timed = together or (lambda: None)

    def step(rows: int, looped: bool):
        ids = torch.zeros(rows * (1 + looped), SEQUENCE // (1 + looped), dtype=torch.long)
        kwargs = {"position_ids": held(SEQUENCE, 2, rank % 2).expand(2 * rows, -1), "sequence_shard": shard} if looped else {}

        def run() -> float:
            timed()
            start = time.perf_counter()
            with loopback() if looped else nullcontext():
                (cp if looped else plain)(input_ids=ids, use_cache=False, **kwargs).logits.sum().backward()
            return time.perf_counter() - start
        return run

    out = {}
    for rows in CP_ROWS:
        sides = (step(rows, False), step(rows, True))
        for side in sides:  # warm both
            side()
        gaps = []
        for i in range(max(2 * repeats, 12)):  # each side first in turn
            first, second = sides[i % 2](), sides[1 - i % 2]()
            gaps.append(second - first if i % 2 == 0 else first - second)
        out[rows] = statistics.median(gaps) / _LAYERS
    dist.destroy_process_group(pairs[rank // 2])  # its threads would slow what calibrate measures next
    return out


def context_work(hardware, config, gaps: dict[int, float]) -> dict | None:
    """The profile's `context_work` ({"layer_s", "per_byte_s"}) from `context_layer_gaps`' `gaps` on `config`'s
    layers: each size's gap less what `hardware` (its other terms) charges a cp 2 layer beyond a plain one on the
    same tokens, its exchanges left out (the scores of the rank's causal blocks, `stage_time`), then a line through
    the two sizes by the keys' and values' bytes gathered; each part at least 0 (a line through 0 where the fixed
    part would be negative, none per byte where the larger size costs less). None without gaps."""
    from ..binding.resolve import resolve
    from ..estimate.activations import plan_sizes
    from ..estimate.memory import with_run
    from ..estimate.stage_time import gathered_kv, stage_times
    from .presets import build_model

    if len(gaps) < 2:
        return None
    model = build_model(config, device="meta")
    plain = with_run(resolve({}, model), seq_len=SEQUENCE)
    split = with_run(resolve({"mesh": {"cp": 2}}, model), seq_len=SEQUENCE)
    bare = hardware.model_copy(update={"context_work": None})
    points = []
    for rows, gap in sorted(gaps.items()):
        one = stage_times(plain, model, bare, batch_size=rows)[0]
        two = stage_times(split, model, bare, batch_size=2 * rows)[0]
        charged = (two.forward + two.backward - two.cp_comm - one.forward - one.backward) / config.num_hidden_layers
        points.append((gathered_kv(plan_sizes(split, model, batch_size=2 * rows)), gap - charged))
    (x0, y0), (x1, y1) = points[0], points[-1]
    slope = (y1 - y0) / (x1 - x0)
    if slope <= 0:
        return {"layer_s": max(statistics.mean(y for _, y in points), 0.0), "per_byte_s": 0.0}
    if y0 - slope * x0 < 0:
        return {"layer_s": 0.0, "per_byte_s": max(sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0)}
    return {"layer_s": y0 - slope * x0, "per_byte_s": slope}
