"""tp past the kv heads: replicated k/v weights (rewrite's design) against Megatron-style all-gathered k/v.

    .venv/bin/python -m bench.kv_replication             # about a minute on 2 cores: tp 4, 8 / 2 heads, r = 2
    .venv/bin/python -m bench.kv_replication --seq 2048  # about two: 4x the tokens, so 4x the all-gather's bytes

One attention block per design, in the same `--world` processes (tp = world, r = tp / kv
ranks per kv head), built from the same full weights:
- `replicated`: k/v `ColumnParallelLinear(..., replicas=r, replica_group=...)`: rank i holds
  kv head i // r whole; its k/v weight gradients are all-reduced over the r replicas.
- `all-gather`: k/v split tp ways (hd / r features of a head per rank), the outputs
  all-gathered over the replica group in forward, reduce-scattered in backward.
Both: q column (this rank's H / tp heads), causal SDPA against the whole kv head, o row,
one backward all-reduce of dL/dx shared by q/k/v. Before timing, the designs must agree
(output, dL/dx, every weight gradient; k/v as the matching rows) within 1e-5 relative, or
the run fails. Then steps alternate between the designs (every other round in reverse
order); a step's time is its slowest rank's. Bytes are computed from the shapes: what each
rank sends with bandwidth-optimal collectives (all-reduce 2(p-1)/p x size, all-gather and
reduce-scatter (p-1)/p x the gathered size; on gloo rewrite's sum sends log2(r) x size, the
same at r = 2). Writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench import common
from rewrite.binding.heads import kv_replicas, replicated_tps
from rewrite.tensor_parallel import comm
from rewrite.tensor_parallel.comm import SharedInputCopy
from rewrite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

TOL = 1e-5  # largest |a - b| / max |b| allowed between the designs (fp32)
DESIGNS = ("replicated", "all-gather")


@dataclass(frozen=True)
class Sizes:
    world: int  # tp ranks, one process each
    hidden: int  # h, the block's input and output features
    heads: int  # H query heads
    kv_heads: int  # kv key/value heads
    head_dim: int  # hd
    seq: int  # s tokens per sequence
    batch: int  # b sequences per microbatch

    @property
    def r(self) -> int:
        return self.world // self.kv_heads  # ranks holding each kv head

    def problems(self) -> list[str]:
        out = []
        if kv_replicas(self.heads, self.kv_heads, self.world) == 1:
            fits = replicated_tps(self.heads, self.kv_heads)
            out.append(f"--world {self.world} must divide --heads {self.heads} and be a multiple of --kv-heads "
                       f"{self.kv_heads} greater than it (kv-head replication): "
                       + (f"--world {' or '.join(map(str, fits))}" if fits else "no --world does; change the heads"))
        elif self.head_dim % self.r:
            out.append(f"--head-dim {self.head_dim} must be a multiple of r = {self.r} "
                       "(the all-gather design splits a head r ways)")
        return out


class _GatherHeads(torch.autograd.Function):
    """(b, s, hd / r) pieces of one head -> the whole (b, s, hd); backward: reduce-scatter of dL/dk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, r = group, dist.get_world_size(group)
        out = x.new_empty((r * x.shape[0], *x.shape[1:]))  # (r * b, s, hd / r), rank-major
        comm.all_gather_into(out, x.contiguous(), group)
        b, s, n = x.shape
        return out.view(r, b, s, n).permute(1, 2, 0, 3).reshape(b, s, r * n)  # (b, s, hd)

    @staticmethod
    def backward(ctx, grad):
        r = dist.get_world_size(ctx.group)
        b, s, hd = grad.shape
        blocks = grad.reshape(b, s, r, hd // r).permute(2, 0, 1, 3).contiguous()  # (r, b, s, hd / r), a private copy
        out = grad.new_empty((b, s, hd // r))
        return comm.reduce_scatter_into(out, blocks.flatten(0, 1), ctx.group), None


class Block(nn.Module):
    """q/k/v column layers, this rank's query heads against its whole kv head, o row layer."""

    def __init__(self, z: Sizes, full: dict[str, torch.Tensor], kv_group, *, replicated: bool):
        super().__init__()
        self.z, self.kv_group, self.replicated = z, kv_group, replicated
        h, q_out, kv_out = z.hidden, z.heads * z.head_dim, z.kv_heads * z.head_dim
        kv = {"replicas": z.r, "replica_group": kv_group} if replicated else {}
        self.q = ColumnParallelLinear(h, q_out, False, full["q"], gather_output=False)
        self.k = ColumnParallelLinear(h, kv_out, False, full["k"], gather_output=False, **kv)
        self.v = ColumnParallelLinear(h, kv_out, False, full["v"], gather_output=False, **kv)
        self.o = RowParallelLinear(q_out, h, False, full["o"])
        self.shared = SharedInputCopy()  # one backward all-reduce of dL/dx for q, k and v
        for lin in (self.q, self.k, self.v):
            lin.input_copy = self.shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.z.head_dim
        q = self.q(x).view(b, s, -1, hd).transpose(1, 2)  # (b, H / tp, s, hd)
        k, v = self.k(x), self.v(x)  # replicated: (b, s, hd); all-gather: (b, s, hd / r)
        self.shared.forget()
        if not self.replicated:
            k, v = _GatherHeads.apply(k, self.kv_group), _GatherHeads.apply(v, self.kv_group)  # (b, s, hd)
        # Every query head of this rank reads the same kv head: a broadcast view, no copy.
        k, v = (t.view(b, 1, s, hd).expand(b, q.shape[1], s, hd) for t in (k, v))  # (b, H / tp, s, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, H / tp, s, hd)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, h)


def _kv_group(z: Sizes, rank: int):
    mine = None
    for slot in range(z.world // z.r):  # new_group is collective: every rank makes every group, in order
        group = dist.new_group(list(range(slot * z.r, (slot + 1) * z.r)))
        if rank // z.r == slot:
            mine = group
    return mine


def _run(block: Block, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = block(x)
    (out * target).sum().backward()
    return out.detach()


def _agreement(blocks: dict[str, Block], x0, target, z: Sizes, rank: int) -> dict[str, float]:
    """Largest relative difference between the designs, over every rank; raises past TOL on every rank alike."""
    got = {}
    for name, block in blocks.items():
        x = x0.clone().requires_grad_()
        got[name] = (_run(block, x, target), x.grad)
    rep, ag = blocks["replicated"], blocks["all-gather"]
    n, piece = z.head_dim // z.r, rank % z.r  # the all-gather rank holds rows [piece * n, (piece + 1) * n) of its head
    pairs = {"output": (got["replicated"][0], got["all-gather"][0]),
             "dL/dx": (got["replicated"][1], got["all-gather"][1]),
             "q_proj grad": (rep.q.weight.grad, ag.q.weight.grad), "o_proj grad": (rep.o.weight.grad, ag.o.weight.grad),
             "k_proj grad": (rep.k.weight.grad[piece * n:(piece + 1) * n], ag.k.weight.grad),
             "v_proj grad": (rep.v.weight.grad[piece * n:(piece + 1) * n], ag.v.weight.grad)}
    rel = torch.tensor([float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in pairs.values()])
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    out = dict(zip(pairs, rel.tolist()))
    bad = {k: v for k, v in out.items() if not v <= TOL}
    if bad:
        raise RuntimeError(f"kv_replication: the designs disagree past {TOL} (relative, worst rank): {bad}")
    for block in blocks.values():
        block.zero_grad(set_to_none=True)
    return out


def _kv_collectives(z: Sizes, group, name: str):
    """One step's k/v collectives alone, on zeros of the real shapes (sums of zeros stay zero)."""
    if name == "replicated":
        grads = [torch.zeros(z.head_dim, z.hidden) for _ in "kv"]  # this rank's whole-head weight grads
        return lambda: [comm.all_reduce_sum(g, group) for g in grads]
    piece, whole = torch.zeros(z.batch, z.seq, z.head_dim // z.r), torch.zeros(z.batch, z.seq, z.head_dim)
    ctx = SimpleNamespace()  # stands in for autograd's context: the Function's steps called directly
    return lambda: [(_GatherHeads.forward(ctx, piece, group), _GatherHeads.backward(ctx, whole)) for _ in "kv"]


def _alternate(runs: dict, warmup: int, steps: int, after=None) -> dict[str, list[float]]:
    """Seconds per call of each run, taking turns (every other round in reverse order)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            t = common.timed(runs[name], warmup=0, steps=1)[0]
            if after is not None:
                after(name)
            if i >= warmup:
                times[name].append(t)
    return times


def measure(rank: int, world: int, z: Sizes, warmup: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    h, q_out, kv_out = z.hidden, z.heads * z.head_dim, z.kv_heads * z.head_dim
    full = {"q": torch.randn(q_out, h, generator=gen) / h**0.5, "k": torch.randn(kv_out, h, generator=gen) / h**0.5,
            "v": torch.randn(kv_out, h, generator=gen) / h**0.5, "o": torch.randn(h, q_out, generator=gen) / q_out**0.5}
    x0 = torch.randn(z.batch, z.seq, h, generator=gen)
    target = torch.randn(z.batch, z.seq, h, generator=gen)
    group = _kv_group(z, rank)
    blocks = {name: Block(z, full, group, replicated=name == "replicated") for name in DESIGNS}
    agree = _agreement(blocks, x0, target, z, rank)
    x = x0.clone().requires_grad_()  # dL/dx is computed, as inside a model

    def clear(name: str) -> None:
        blocks[name].zero_grad(set_to_none=True)
        x.grad = None

    times = _alternate({n: (lambda n=n: _run(blocks[n], x, target)) for n in DESIGNS}, warmup, steps, clear)
    alone = _alternate({n: _kv_collectives(z, group, n) for n in DESIGNS}, warmup, steps)
    kv_bytes = {name: sum(p.numel() * p.element_size() for p in (*b.k.parameters(), *b.v.parameters()))
                for name, b in blocks.items()}
    return {"times": times, "collectives": alone, "agreement": agree, "kv_param_bytes": kv_bytes}


def traffic(z: Sizes, elem: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step (one microbatch forward + backward), from the shapes."""
    r, p, tokens = z.r, z.world, z.batch * z.seq
    return {"replicated": 2 * z.hidden * z.head_dim * elem * 2 * (r - 1) / r,  # k, v weight grads: all-reduce over r
            "all-gather": 2 * 2 * tokens * z.head_dim * elem * (r - 1) / r,  # k, v outputs: gather fwd, scatter bwd
            "tp": 2 * tokens * z.hidden * elem * 2 * (p - 1) / p}  # both: o_proj's sum, dL/dx's sum


def command(args: argparse.Namespace) -> str:
    opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    return f".venv/bin/python -m bench.kv_replication {opts}"


def report(z: Sizes, runs: list[dict], args: argparse.Namespace) -> str:
    sent, kib, rows = traffic(z), 1024, []
    for key, what in (("times", "step"), ("collectives", "k/v collectives alone")):
        slow = {n: [max(ts) for ts in zip(*(r[key][n] for r in runs))] for n in DESIGNS}  # slowest rank per round
        med = {n: statistics.median(slow[n]) for n in DESIGNS}
        paired = statistics.median(a / b for a, b in zip(slow["replicated"], slow["all-gather"]))
        rows.append([f"{1e3 * med[n]:.2f} ({1e3 * min(slow[n]):.2f}-{1e3 * max(slow[n]):.2f})" for n in DESIGNS])
        rows[-1].append(f"replicated / all-gather, {what}: {med['replicated'] / med['all-gather']:.3f} "
                        f"(ratio of medians), {paired:.3f} (median of per-round ratios)")
    count = {"replicated": "2 all-reduce", "all-gather": "2 all-gather + 2 reduce-scatter"}
    out = [f"tp {z.world}, hidden {z.hidden}, {z.heads} heads / {z.kv_heads} kv heads, hd {z.head_dim}, r = {z.r}, "
           f"microbatch {z.batch} x {z.seq} tokens, fp32, {args.steps} timed steps after {args.warmup}", "",
           "| design | median step ms (range) | k/v collectives alone ms (range) | k/v collectives per step "
           "| k/v params per rank KiB | k/v bytes sent per rank per step KiB |", "|---|---|---|---|---|---|"]
    for i, n in enumerate(DESIGNS):
        out.append(f"| {n} | {rows[0][i]} | {rows[1][i]} | {count[n]} | {runs[0]['kv_param_bytes'][n] / kib:.0f} "
                   f"| {sent[n] / kib:.0f} |")
    out += ["", rows[0][2], rows[1][2],
            f"k/v bytes sent, replicated / all-gather: {sent['replicated'] / sent['all-gather']:.3f} "
            f"(= hidden / tokens = {z.hidden} / {z.batch * z.seq}); both also send {sent['tp'] / kib:.0f} KiB "
            "in the two tp all-reduces",
            "agreement (max relative difference, worst rank): "
            + ", ".join(f"{k} {v:.1e}" for k, v in runs[0]["agreement"].items()), "", command(args)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="tp ranks (processes)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=41, help="timed steps per design")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    args = parser.parse_args()
    z = Sizes(args.world, args.hidden, args.heads, args.kv_heads, args.head_dim, args.seq, args.batch)
    if problems := z.problems():  # before any process starts
        sys.exit("bench.kv_replication: " + "; ".join(problems))
    runs = common.launch(measure, z.world, z, args.warmup, args.steps)
    print(report(z, runs, args))


if __name__ == "__main__":
    main()
