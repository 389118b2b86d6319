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
TORCH_SCHEDULES = {"afab": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def _torch_pipeline(rank: int, world: int, cut: int, schedule: str = "afab"):
    """Two hand-carved stages, layers [0, cut) and [cut, n), under torch's counterpart of `schedule`."""
    from torch.distributed import pipelining

    if world != 2:
        raise ValueError(f"the hand-carved baseline has two stages, not {world}; run it with world=2")
    lm = common.model()
    n = lm.config.num_hidden_layers
    carved = _HandStage(lm, 0 if rank == 0 else cut, cut if rank == 0 else n, rank == 0, rank == 1)
    del lm
    stage = pipelining.PipelineStage(carved, rank, world, torch.device("cpu"))
    schedule_cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    runner = schedule_cls(stage, n_microbatches=common.MICROBATCHES, loss_fn=rewrite.causal_lm_loss)
    ids, targets = common.batch()
    full_ids, full_targets = torch.cat(ids), torch.cat(targets)  # the schedule splits them again

    def step():
        if rank == 0:
            runner.step(full_ids)
        else:
            runner.step(target=full_targets, losses=[], return_outputs=False)
        carved.zero_grad(set_to_none=True)

    return carved, step, stage


def _ours(rank: int, world: int, cut: int, schedule: str = "afab"):
    lm = common.model()
    pipeline = {"microbatches": common.MICROBATCHES, "schedule": schedule, "cut_points": [f"model.layers.{cut}"]}
    stage = rewrite.apply_plan(lm, {"mesh": {"pp": world}, "pipeline": pipeline})
    ids, targets = common.batch()
    busy = []

    def step():
        start = time.time()
        rewrite.run_schedule(stage, ids, targets)  # the plan's schedule
        wall = time.time() - start
        busy.append(sum(e.end - e.start for e in stage.timeline) / wall)
        stage.module.zero_grad(set_to_none=True)

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
