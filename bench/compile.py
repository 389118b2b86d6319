"""Compiled steps: each plan with `compile` against the same plan eager, and against torch's own compiled
equivalents.

    .venv/bin/python -m bench.compile                                  # about 25 minutes on 2 cores
    .venv/bin/python -m bench.compile --pairs tp2,dp2-full --rounds 1 --steps 3   # a quick look

The bench model in float32 on 2 ranks, one step of the global batch (`common.batch`: 8 microbatches of
[2, 128]; cp 2: one sequence of 4,096 tokens); one-stage plans run `1f1b`, each microbatch's forward then its
backward, as torch's sides loop. Each side runs alone in a fresh pair of processes (as
`bench.turns`), the sides of a pair one after the other, their order turned every round; a run's time is the
median over its steps of the slower rank's, after the warm-up steps (which compile: the first compile of a
plan takes seconds, later runs read inductor's cache). Pairs, first / second:
- each layout compiled (inductor, per block) against itself eager: tp 2, tp 2 + sp (`plans/llama-tp2-sp.yaml`:
  vocabulary-parallel embedding and loss), pp 2 1f1b, pp 2 zbv, dp 2 `full`, cp 2, and ep 2 (dp 2) on the
  bench MoE (`bench-qwen3-moe`, each rank 4 rows of 256 tokens, as `bench.expert_parallel`) (target: tp 2
  <= 0.95);
- rewrite compiled against torch's own compiled equivalents (each <= 1.0): tp 2 against DTensor's
  `parallelize_module` with each decoder layer compiled; pp 2 1f1b against torch.distributed.pipelining's
  `Schedule1F1B` over hand-carved stages whose layers are compiled; dp 2 `full` against FSDP2 with each layer
  compiled and then sharded (torchtitan's order).
Writes the "compile" entry of bench/results.json.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import rewrite
from bench import common, dp, expert_parallel, pp, turns

ROOT = Path(__file__).resolve().parents[1]

WORLD = 2
CP_SEQ = 4096
COMPILE = {"backend": "inductor"}
LAYOUTS = ("tp2", "tp2-sp", "pp2-1f1b", "pp2-zbv", "dp2-full", "cp2", "ep2-moe")
PAIRS = {
    **{layout: (f"{layout} compiled", f"{layout} eager") for layout in LAYOUTS},
    "tp2 / DTensor": ("tp2 compiled", "DTensor tp2 compiled"),
    "pp2-1f1b / torch": ("pp2-1f1b compiled", "torch 1f1b compiled"),
    "dp2-full / FSDP2": ("dp2-full compiled", "FSDP2 full compiled"),
}


def _plan(layout: str, microbatches: int) -> dict:
    # One stage: each microbatch's forward then its backward (1F1B on one stage), as torch's sides loop.
    pipeline = {"microbatches": microbatches, "schedule": "1f1b"}
    if layout == "tp2":
        return {"mesh": {"tp": WORLD}, "pipeline": pipeline,
                "tensor_parallel": rewrite.plan_from_hf(common.model(), tp=WORLD).tensor_parallel}
    if layout == "tp2-sp":
        plan = rewrite.load_plan(ROOT / "plans/llama-tp2-sp.yaml").model_dump(mode="json", exclude_none=True)
        return {**plan, "pipeline": pipeline}
    if layout.startswith("pp2"):
        schedule = layout.split("-")[1]
        pipeline = {**pipeline, "schedule": schedule,
                    "cut_points": [f"model.layers.{c}" for c in pp.layer_cuts(schedule, WORLD, 4, 8)]}
        if schedule in pp.VIRTUAL_STAGES:
            pipeline["virtual_stages"] = pp.VIRTUAL_STAGES[schedule]
        return {"mesh": {"pp": WORLD}, "pipeline": pipeline}
    if layout == "dp2-full":
        return {"mesh": {"dp": WORLD}, "data_parallel": {"sharding": "full"}, "pipeline": pipeline}
    if layout == "ep2-moe":
        return {"mesh": {"dp": WORLD, "ep": WORLD}, "tensor_parallel": expert_parallel.RULE, "pipeline": pipeline}
    return {"mesh": {"cp": WORLD}, "pipeline": {**pipeline, "seq_len": CP_SEQ}}


def _batch(rank: int, layout: str):
    if layout == "dp2-full":
        return dp._mine(rank)
    if layout == "ep2-moe":  # each rank its own 4 rows of 256 tokens, as bench.expert_parallel
        ids = expert_parallel._rows(256, 4, WORLD)[rank]
        return [ids[:, :-1].contiguous()], [ids[:, 1:].contiguous()]
    if layout == "cp2":
        ids = torch.randint(0, common.model().config.vocab_size, (1, CP_SEQ + 1), generator=torch.Generator().manual_seed(0))
        return [ids[:, :-1].contiguous()], [ids[:, 1:].contiguous()]
    return common.batch()


def _ours(rank: int, layout: str, compiled: bool):
    ids, targets = _batch(rank, layout)
    plan = _plan(layout, len(ids))
    if compiled:
        plan["compile"] = COMPILE
    torch.manual_seed(0)
    model = common.build_model(expert_parallel.MODEL) if layout == "ep2-moe" else common.model()
    stage = rewrite.apply_plan(model, plan)
    return stage.module, lambda: rewrite.run_schedule(stage, ids, targets)


def _compiled_layers(layers: nn.ModuleList) -> None:
    """Each decoder layer replaced by its compiled wrapper (torchtitan's per-block compile)."""
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer)


def _dtensor(rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    lm = common.model()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(lm, init_device_mesh("cpu", (WORLD,)),
                       {f"model.{k}": styles[v]() for k, v in lm.config.base_model_tp_plan.items()})
    _compiled_layers(lm.model.layers)
    return lm, common.accumulation_step(lm)


def _torch_1f1b(rank: int):
    original = pp._HandStage.__init__

    def init(self, *args, **kwargs):  # the hand-carved stage, its layers compiled
        original(self, *args, **kwargs)
        _compiled_layers(self.layers)

    pp._HandStage.__init__ = init
    try:
        module, step, _ = pp._torch_pipeline(rank, WORLD, 4, "1f1b")
    finally:
        pp._HandStage.__init__ = original
    return module, step


def _fsdp2(rank: int):
    from torch.distributed.fsdp import fully_shard

    ids, targets = dp._mine(rank)
    lm = common.model()
    _compiled_layers(lm.model.layers)
    for layer in lm.model.layers:
        fully_shard(layer)
    fully_shard(lm)

    class _Sync:
        def __init__(self, last):
            self.last = last

        def __enter__(self):
            lm.set_requires_gradient_sync(self.last)

        def __exit__(self, *exc):
            return False

    return lm, lambda: dp._accumulate(lm, ids, targets, _Sync)


def _build(rank: int, world: int, side: str):
    """(module, step) of one side; `step()` runs one training step, gradients left to clear."""
    if side == "DTensor tp2 compiled":
        return _dtensor(rank)
    if side == "torch 1f1b compiled":
        return _torch_1f1b(rank)
    if side == "FSDP2 full compiled":
        return _fsdp2(rank)
    layout, how = side.rsplit(" ", 1)
    return _ours(rank, layout, how == "compiled")


def main() -> None:
    parser = turns.turn_flags(__doc__.splitlines()[0], PAIRS)
    args = parser.parse_args()
    pairs = turns.chosen_pairs(parser, args, PAIRS)
    res = turns.measure(pairs, args.rounds, args.warmup, args.steps, sides=PAIRS, build=_build)
    print(turns.table(res, PAIRS, heads=("first", "second"), by_name=True))
    common.save_result(args.out, "compile", {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                                             "pairs": res})


if __name__ == "__main__":
    main()
