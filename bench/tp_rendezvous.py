"""TP = 2: where a step's exchanges spend their time, and whether overlapping them with products helps.

    .venv/bin/python -m bench.tp_rendezvous               # about 1.5 minutes on 2 cores
    .venv/bin/python -m bench.tp_rendezvous --steps 9     # more steps a run

On CPU with gloo every tp collective of rewrite's is pairwise swaps (`tensor_parallel.comm.swap`).
Each swap is recorded on both ranks (one clock: Linux's monotonic clock is the machine's): when the
rank called it, when its send and receive were posted, when it began to wait and when the wait
ended. Paired across the ranks (both make the same swaps in the same order), a rank's time in a
swap splits into

- `posting`: handing the send and receive to gloo;
- `peer late`: waiting before the peer had even posted (the ranks' drift: the one who arrives
  first waits for the other);
- `transfer`: the rest of the wait (the bytes, gloo's I/O thread, waking the waiting thread).

Runs, in the same two processes and taking turns step by step, on the bench model and batch:
`plain`, `vocab+lp`, `vocab+lp+sp` (`bench.tp_options`' plans), and `vocab+lp+sp overlapped`:
the sp plan with each row layer's reduce-scatter made as in async tensor parallelism's
"collective matmul" (defined here, not in rewrite): the rows its peer keeps computed first and
sent while the rank computes its own; backward, its chunk of the output gradient sent while it
computes its own rows' gradients. Writes the "tp_rendezvous" entry of bench/results.json.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import common
from bench.tp_options import _runner, plan_for
from rewrite.tensor_parallel import comm, layers
from rewrite.tensor_parallel.sequence import _chunk, sequence_chunk

RUNS = ("plain", "vocab+lp", "vocab+lp+sp", "vocab+lp+sp overlapped")
_OVERLAPPED = " overlapped"


class _Log:
    """The swaps of the step in flight: (called, posted, wait began, wait ended) each."""

    swaps: list[tuple[float, float, float, float]] = []
    overlap = False  # the row layers under sequence parallelism overlap their swaps


def _start(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> tuple[list, float, float]:
    called = time.perf_counter()
    peer = dist.get_global_rank(group, peer) if group is not None else peer
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
    return works, called, time.perf_counter()


def _finish(works: list, called: float, posted: float) -> None:
    began = time.perf_counter()
    for work in works:
        work.wait()
    _Log.swaps.append((called, posted, began, time.perf_counter()))


def _recorded_swap(send, recv, peer, group) -> None:
    _finish(*_start(send, recv, peer, group))


class _RowScatterOverlapped(torch.autograd.Function):
    """`reduce_scatter_to_sequence(F.linear(x, weight))` over a pair, each swap beside half the products."""

    @staticmethod
    def forward(ctx, x, weight, group):
        rank = dist.get_rank(group)
        c = sequence_chunk(x.shape[-2], 2)
        theirs = F.linear(_chunk(x, 1 - rank, c), weight)
        received = torch.empty_like(theirs)
        pending = _start(theirs, received, 1 - rank, group)
        mine = F.linear(_chunk(x, rank, c), weight)
        _finish(*pending)
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return mine.add_(received)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rank, length, c = dist.get_rank(ctx.group), x.shape[-2], grad.shape[-2]
        mine = grad.contiguous()
        theirs = torch.empty_like(mine)
        pending = _start(mine, theirs, 1 - rank, ctx.group)
        parts = {rank: _grads(mine, x, weight, rank, c, length)}
        _finish(*pending)
        parts[1 - rank] = _grads(theirs, x, weight, 1 - rank, c, length)
        return torch.cat([parts[0][0], parts[1][0]], dim=-2), parts[0][1].add_(parts[1][1]), None


def _grads(grad, x, weight, i: int, c: int, length: int):
    """Chunk `i`'s rows of dL/dx and its term of dL/dW, the padding rows dropped."""
    start = min(i * c, length)
    rows = x.narrow(-2, start, min(c, length - start))
    g = grad.narrow(-2, 0, rows.shape[-2])
    return g @ weight, g.reshape(-1, g.shape[-1]).t() @ rows.reshape(-1, rows.shape[-1])


def _row_forward(original):
    def forward(self, x):
        if _Log.overlap and self.sequence_parallel and self.bias is None and self.lora_A is None:
            return _RowScatterOverlapped.apply(x, self.weight, self.group)
        return original(self, x)

    return forward


def measure(rank: int, world: int, warmup: int, steps: int) -> dict:
    """Per run, per timed step: its seconds and this rank's swaps."""
    comm.swap = _recorded_swap
    layers.RowParallelLinear.forward = _row_forward(layers.RowParallelLinear.forward)
    runs = {}
    for name in RUNS:
        lm = common.model()
        runs[name] = (lm, _runner(lm, plan_for(name.removesuffix(_OVERLAPPED), lm.config, world)))
    out = {name: {"seconds": [], "swaps": []} for name in RUNS}
    for i in range(warmup + steps):
        for name in RUNS if i % 2 == 0 else RUNS[::-1]:
            module, step = runs[name]
            _Log.swaps, _Log.overlap = [], name.endswith(_OVERLAPPED)
            dist.barrier()
            began = time.perf_counter()
            loss = step()
            seconds = time.perf_counter() - began
            module.zero_grad(set_to_none=True)
            if i >= warmup:
                out[name]["seconds"].append(seconds)
                out[name]["swaps"].append(list(_Log.swaps))
                out[name]["loss"] = loss  # the overlapped run's must be the sp run's (within rounding)
    return out


def split(mine: list, peers: list) -> dict[str, float]:
    """One rank's seconds in its swaps of a step: posting, peer late, transfer (module docstring)."""
    if len(mine) != len(peers):
        raise RuntimeError(f"the ranks made {len(mine)} and {len(peers)} swaps: they cannot be paired")
    parts = {"posting": 0.0, "peer late": 0.0, "transfer": 0.0}
    for (called, posted, began, ended), peer in zip(mine, peers):
        late = max(0.0, min(ended, peer[1]) - began)
        parts["posting"] += posted - called
        parts["peer late"] += late
        parts["transfer"] += ended - began - late
    return parts


def summarize(ranks: list[dict]) -> dict:
    """Per run: the median step (the slower rank's), swaps a step, and the mean rank's ms a step in each part."""
    out = {}
    for name in RUNS:
        steps = len(ranks[0][name]["seconds"])
        slow = [max(r[name]["seconds"][i] for r in ranks) for i in range(steps)]
        parts: dict[str, list[float]] = {}
        for i in range(steps):
            a, b = (r[name]["swaps"][i] for r in ranks)
            for mine, peers in ((a, b), (b, a)):
                for part, seconds in split(mine, peers).items():
                    parts.setdefault(part, []).append(seconds)
        out[name] = {"step_s": common.median(slow), "swaps": len(ranks[0][name]["swaps"][0]), "loss": ranks[0][name]["loss"],
                     **{f"{part}_ms": 1e3 * common.median(v) for part, v in parts.items()}}
    return out


def table(res: dict) -> str:
    plain = res["plain"]["step_s"]
    rows = ["| run | step (s) | x plain | swaps a step | posting, ms a step | peer late | transfer | in swaps, total | loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        total = r["posting_ms"] + r["peer late_ms"] + r["transfer_ms"]
        rows.append(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / plain:.2f} | {r['swaps']} | {r['posting_ms']:.0f} "
                    f"| {r['peer late_ms']:.0f} | {r['transfer_ms']:.0f} | {total:.0f} | {r['loss']:.6f} |")
    return "\n".join(rows)


def main() -> None:
    parser = common.step_parser(__doc__, steps=5, entry="tp_rendezvous")
    args = parser.parse_args()
    start = time.time()
    res = summarize(common.launch(measure, 2, args.warmup, args.steps))
    print(table(res))
    common.save_result(args.out, "tp_rendezvous", {"runs": res, "steps": args.steps, "wall_s": time.time() - start})


if __name__ == "__main__":
    main()
