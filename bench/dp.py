"""DP = 2, the same global batch: rewrite's data parallelism against torch's, and one process.

    .venv/bin/python -m bench.dp            # about 2 minutes on 2 cores
    .venv/bin/python -m bench.dp --steps 3  # a quick look

Every step runs the bench model on the global batch (`common.batch`: 8 microbatches of
[2, 128]); each of the 2 replicas takes 4 microbatches. Side by side, in the same two
processes, alternating step by step:
- rewrite `data_parallel.sharding: replicate` against torch `DistributedDataParallel`
  (gradient accumulation under `no_sync` but for the last microbatch);
- rewrite `full` against torch FSDP2 applied by hand (`fully_shard` per decoder layer and at the
  root; gradient sync off but for the last microbatch);
- rewrite `grad_op`, for its time.
Then one process on one thread runs the whole global batch. Memory per rank: the parameter,
gradient and AdamW-state bytes each holds after an optimizer step (`full` against `replicate`).
Writes the "dp" entry of bench/results.json.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import rewrite
from bench import common

REPLICAS = 2
SIDES = ("rewrite replicate", "torch DDP", "rewrite full", "torch FSDP2", "rewrite grad_op")


def _mine(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ids, targets = common.batch()
    per = len(ids) // REPLICAS
    return ids[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]


def _ours(rank: int, sharding: str, compute_dtype: torch.dtype | None = None):
    ids, targets = _mine(rank)
    plan = {"mesh": {"dp": REPLICAS}, "data_parallel": {"sharding": sharding}, "pipeline": {"microbatches": len(ids)}}
    stage = rewrite.apply_plan(common.model(), plan, compute_dtype=compute_dtype)
    return stage.module, lambda: rewrite.run_schedule(stage, ids, targets)


def _accumulate(lm, ids, targets, sync):
    total = torch.zeros(())
    for i, (x, y) in enumerate(zip(ids, targets)):
        with sync(i == len(ids) - 1):
            loss = rewrite.causal_lm_loss(lm(input_ids=x).logits, y) / len(ids)
            loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    return total / REPLICAS


def _ddp(rank: int):
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel

    ids, targets = _mine(rank)
    lm = DistributedDataParallel(common.model())
    return lm.module, lambda: _accumulate(lm, ids, targets, lambda last: nullcontext() if last else lm.no_sync())


def _fsdp2(rank: int, compute_dtype: torch.dtype | None = None):
    """torch's FSDP2 on the same units; with `compute_dtype`, the same mixed precision policy as the recipe's
    (`MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)`)."""
    from contextlib import contextmanager

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ids, targets = _mine(rank)
    lm = common.model()
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    for layer in lm.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(lm, mp_policy=policy)

    @contextmanager
    def sync(last: bool):
        lm.set_requires_gradient_sync(last)
        yield

    return lm, lambda: _accumulate(lm, ids, targets, sync)


def _state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    grads = sum(local(p.grad) for p in module.parameters() if p.grad is not None)
    adamw = sum(local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"params": common.param_bytes(module), "grads": grads, "adamw": adamw}


def compare(rank: int, world: int, warmup: int, steps: int) -> dict:
    runs = {
        "rewrite replicate": _ours(rank, "replicate"),
        "torch DDP": _ddp(rank),
        "rewrite full": _ours(rank, "full"),
        "torch FSDP2": _fsdp2(rank),
        "rewrite grad_op": _ours(rank, "grad_op"),
    }
    times: dict[str, list[float]] = {key: [] for key in runs}
    for i in range(warmup + steps):
        for key in runs if i % 2 == 0 else list(runs)[::-1]:  # alternate: drift hits all alike
            module, step = runs[key]
            t = common.timed(step, warmup=0, steps=1)[0]
            module.zero_grad(set_to_none=True)
            if i >= warmup:
                times[key].append(t)
    out = {"times": times, "loss": {}, "memory": {}}
    for key, (module, step) in runs.items():
        dist.barrier()
        out["loss"][key] = float(step())
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        optimizer.step()
        out["memory"][key] = _state_bytes(module, optimizer)
        module.zero_grad(set_to_none=True)
    return out


def one_process(warmup: int, steps: int) -> list[float]:
    return common.timed(common.accumulation_step(common.model()), warmup=warmup, steps=steps)


def summarize(runs: list[dict], single: list[float]) -> dict:
    """Medians over the slower rank of each step, the ratios the targets name, memory per rank."""
    slow = {k: [max(r["times"][k][i] for r in runs) for i in range(len(runs[0]["times"][k]))] for k in SIDES}
    med = {k: common.median(v) for k, v in slow.items()}
    one = common.median(single)
    mem = {k: max(sum(r["memory"][k].values()) for r in runs) for k in SIDES}
    losses = {k: runs[0]["loss"][k] for k in SIDES}
    return {
        "median_s": med,
        "one_process_s": one,
        "ratios": {
            "replicate / DDP": med["rewrite replicate"] / med["torch DDP"],
            "full / FSDP2": med["rewrite full"] / med["torch FSDP2"],
            "replicate / one process": med["rewrite replicate"] / one,
            "full / one process": med["rewrite full"] / one,
            "grad_op / one process": med["rewrite grad_op"] / one,
            "DDP / one process": med["torch DDP"] / one,
            "params+grads+AdamW full / replicate": mem["rewrite full"] / mem["rewrite replicate"],
        },
        "state_bytes_per_rank": mem,
        "loss": losses,
        "loss_equal": all(math.isclose(v, losses["torch DDP"], rel_tol=1e-5, abs_tol=1e-6) for v in losses.values()),
    }


def table(res: dict) -> str:
    rows = ["| run | median step (s) | x one process | params + grads + AdamW per rank (MiB) | loss |", "|---|---|---|---|---|"]
    for k in SIDES:
        rows.append(f"| {k} | {res['median_s'][k]:.3f} | {res['median_s'][k] / res['one_process_s']:.2f} | "
                    f"{res['state_bytes_per_rank'][k] / 2**20:.2f} | {res['loss'][k]:.6f} |")
    rows.append(f"| one process, one thread | {res['one_process_s']:.3f} | 1.00 | | |")
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in res["ratios"].items())
    return "\n".join(rows) + f"\n\n{ratios}; losses equal: {res['loss_equal']}"


def main() -> None:
    parser = common.step_parser(__doc__, steps=7, per="implementation", entry="dp")
    args = parser.parse_args()
    runs = common.launch(compare, REPLICAS, args.warmup, args.steps)
    single = common.single_process(one_process, args.warmup, args.steps)
    res = summarize(runs, single)
    print(table(res))
    common.save_result(args.out, "dp", res)


if __name__ == "__main__":
    main()
