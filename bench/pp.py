"""PP = 2, AFAB: rewrite's run_schedule vs torch.distributed.pipelining ScheduleGPipe vs one process.

Both pipelines run in the same two processes and alternate step by step, so
machine noise hits them alike. `_ours` and `_torch_pipeline` build either side under
any of rewrite's named schedules (bench.schedules compares them schedule by schedule).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import rewrite
from bench import common


class _HandStage(nn.Module):
    """A hand-carved stage of a LLaMA: [embeddings] -> layers[lo:hi] -> [norm, head]."""

    def __init__(self, lm, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.embed = lm.model.embed_tokens if first else None
        self.rotary = lm.model.rotary_emb
        self.layers = nn.ModuleList(lm.model.layers[lo:hi])
        self.norm = lm.model.norm if last else None
        self.head = lm.lm_head if last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x  # (mb, seq, hidden)
        position_ids = torch.arange(h.shape[1]).unsqueeze(0)
        pos = self.rotary(h, position_ids)
        for layer in self.layers:
            # attention_mask=None: SDPA applies the causal mask itself, as in rewrite's stages.
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pos)
        if self.head is not None:
            h = self.head(self.norm(h))  # (mb, seq, vocab)
        return h


# rewrite's named schedules and their counterparts in torch.distributed.pipelining.
TORCH_SCHEDULES = {
    "afab": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
# Stages per rank (pipeline.virtual_stages); 1 where not listed.
VIRTUAL_STAGES = {"interleaved-1f1b": 2, "zero-bubble": 2, "zbv": 2}


def layer_cuts(schedule: str, world: int, cut: int, n_layers: int) -> list[int]:
    """First layer of each stage after the first: `[cut]` with one stage per rank, else an even split."""
    k = VIRTUAL_STAGES.get(schedule, 1)
    if k == 1:
        return [cut]
    num_stages = world * k
    if n_layers < num_stages:
        raise ValueError(f"{schedule}: {num_stages} stages need at least {num_stages} layers, the model has {n_layers}")
    return [n_layers * s // num_stages for s in range(1, num_stages)]


def held_stages(schedule: str, rank: int, world: int) -> list[int]:
    """Stages rank `rank` holds: looped (r, r + pp, ...), or V-shaped (r, 2pp - 1 - r) for zbv."""
    k = VIRTUAL_STAGES.get(schedule, 1)
    if schedule == "zbv":
        return [rank, 2 * world - 1 - rank]
    return [rank + v * world for v in range(k)]


def _torch_pipeline(rank: int, world: int, cut: int, schedule: str = "afab"):
    """Hand-carved stages under torch's counterpart of `schedule`: returns (module, step, its PipelineStages).

    One stage per rank, layers [0, cut) and [cut, n); or, for the virtual-stage schedules,
    2 * world stages of n / (2 * world) layers placed as `held_stages` says. `step(keep_grads=False)`
    runs one step and returns its loss (mean over microbatches) on the rank holding the last stage.
    """
    from torch.distributed import pipelining

    lm = common.model()
    n = lm.config.num_hidden_layers
    starts = [0, *layer_cuts(schedule, world, cut, n), n]
    num_stages = len(starts) - 1
    held = held_stages(schedule, rank, world)
    carved = [_HandStage(lm, starts[s], starts[s + 1], s == 0, s == num_stages - 1) for s in held]
    del lm
    stages = [pipelining.PipelineStage(c, s, num_stages, torch.device("cpu")) for c, s in zip(carved, held)]
    schedule_cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    runner = schedule_cls(stages if num_stages > world else stages[0], n_microbatches=common.MICROBATCHES,
                          loss_fn=rewrite.causal_lm_loss)
    module = carved[0] if len(carved) == 1 else nn.ModuleList(carved)
    ids, targets = common.batch()
    full_ids, full_targets = torch.cat(ids), torch.cat(targets)  # the schedule splits them again
    args = (full_ids,) if 0 in held else ()
    target = full_targets if num_stages - 1 in held else None

    def step(keep_grads: bool = False):
        losses: list[torch.Tensor] = []
        runner.step(*args, target=target, losses=losses, return_outputs=False)
        if not keep_grads:
            module.zero_grad(set_to_none=True)
        # Summed as rewrite's runner sums them (each microbatch's loss / m), for a like-for-like parity check.
        return torch.stack([l.detach() / len(losses) for l in losses]).sum() if losses else None

    return module, step, stages


def _ours(rank: int, world: int, cut: int, schedule: str = "afab"):
    """rewrite's side under the plan's `schedule`, on the same layer split as `_torch_pipeline`."""
    lm = common.model()
    cuts = layer_cuts(schedule, world, cut, lm.config.num_hidden_layers)
    pipeline = {"microbatches": common.MICROBATCHES, "schedule": schedule,
                "cut_points": [f"model.layers.{c}" for c in cuts]}
    if schedule in VIRTUAL_STAGES:
        pipeline["virtual_stages"] = VIRTUAL_STAGES[schedule]
    stage = rewrite.apply_plan(lm, {"mesh": {"pp": world}, "pipeline": pipeline})
    ids, targets = common.batch()
    busy = []

    def step(keep_grads: bool = False):
        start = time.time()
        loss = rewrite.run_schedule(stage, ids, targets)  # the plan's schedule
        wall = time.time() - start
        busy.append(sum(e.end - e.start for e in stage.timeline) / wall)
        if not keep_grads:
            stage.module.zero_grad(set_to_none=True)
        return loss

    return stage, step, busy


def timing(rank: int, world: int, warmup: int, steps: int, cut: int = 4) -> dict:
    ours_module, ours_step, busy = _ours(rank, world, cut)
    gpipe_module, gpipe_step, _ = _torch_pipeline(rank, world, cut)
    ours, gpipe = [], []
    for i in range(warmup + steps):  # alternate, so drift affects both alike
        t_ours = common.timed(ours_step, warmup=0, steps=1)[0]
        t_gpipe = common.timed(gpipe_step, warmup=0, steps=1)[0]
        if i >= warmup:
            ours.append(t_ours)
            gpipe.append(t_gpipe)
    return {"ours": ours, "gpipe": gpipe, "busy": busy[warmup:]}


def memory(rank: int, world: int, impl: str) -> dict:
    """Parameter bytes and peak RSS of one implementation alone in its processes."""
    module, step = (_torch_pipeline(rank, world, 4) if impl == "gpipe" else _ours(rank, world, 4))[:2]
    for _ in range(2):
        step()
    dist.barrier()
    return {"param_bytes": common.param_bytes(module), "peak_rss_mib": common.peak_rss_mib()}


def one_process(warmup: int, steps: int) -> dict:
    """The same batch, one process, one thread: plain gradient accumulation."""
    lm = common.model()
    step = common.accumulation_step(lm)
    times = common.timed(step, warmup=warmup, steps=steps, barrier=False)
    return {"times": times, "param_bytes": common.param_bytes(lm), "peak_rss_mib": common.peak_rss_mib()}
