"""What the experts' all-to-alls cost inside a step beyond their time alone (`Hardware.call_overhead_s`
`all_to_all` and `all_to_all_tp`), as `rewrite calibrate` measures it: a mixture of experts split as the
planner's ep plans split it, timed with its all-to-alls made and looped back (any tp collectives made both ways).

What an exchange costs beyond its time alone is mostly the ranks' drift since they last met, absorbed there. Its
experts over dp ranks alone (`all_to_all`), a layer's exchanges are the only place its ranks meet: 2-3 ms an
exchange at world 4 on 2 cores. Over a tp pair with sequence parallelism (`all_to_all_tp`), they meet at the
attention's gathers and reduce-scatters too, and the exchanges cost about 0.7 ms each beyond their time alone.
"""

from __future__ import annotations

from .calibrate_layers import SEQUENCE, TP_LAYERS, TP_SHAPE

__all__ = ["EP_MODEL", "ep_call_times", "exchange_overheads"]

EP_MODEL = "bench-qwen3-moe"  # 8 experts of width 256, 2 a token: 4 on each rank of a pair


def ep_call_times(repeats: int, together=None) -> dict[str, dict]:
    """What an ep 2 model's all-to-alls cost inside its forwards and backwards, its experts split over each pair
    of ranks (0-1, 2-3, ...; all pairs at once): {"all_to_all": times, "all_to_all_tp": times} for EP_MODEL of
    TP_LAYERS layers (as the tp model's), the pair as dp 2 x ep 2 and as tp 2 x ep 2 (the attention split over it
    with sequence parallelism), each `calibrate_layers.made_and_free`'s times on TP_SHAPE microbatches and
    sequences of SEQUENCE tokens of random ids (the router spreading them over the experts) with the all-to-alls
    made and looped back; its `swaps`: the bytes each rank sends in each all-to-all. {} for an odd world.
    Collective: every rank of the default group calls it."""
    import torch
    import torch.distributed as dist

    from ..binding.resolve import resolve
    from ..expert_parallel import apply_expert_parallel
    from ..mesh import Mesh
    from ..models.blocks import ATTENTION
    from ..tensor_parallel.apply import apply_tensor_parallel
    from .calibrate_layers import made_and_free
    from .presets import build_config, build_model

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % 2:
        return {}
    pair = [dist.new_group([r, r + 1]) for r in range(0, world, 2)][rank // 2]
    attention = {f"model.layers.*.{ATTENTION.layer_part}.{name}": "column" for name in ATTENTION.inputs}
    attention[f"model.layers.*.{ATTENTION.layer_part}.{ATTENTION.output}"] = "row"
    microbatches, rows = TP_SHAPE
    out = {}
    for kind, dp, tp in (("all_to_all", 2, 1), ("all_to_all_tp", 1, 2)):
        torch.manual_seed(0)  # the same weights on both ranks of a pair, as apply_plan starts from
        model = build_model(build_config(EP_MODEL, num_hidden_layers=TP_LAYERS))
        plan = {"mesh": {"dp": dp, "tp": tp, "ep": 2}, "sequence_parallel": tp > 1,
                "tensor_parallel": {**(attention if tp > 1 else {}), "model.layers.*.mlp.experts": "expert_parallel"}}
        resolved = resolve(plan, model, world_size=2)
        if tp > 1:
            apply_tensor_parallel(model, resolved, pair)
        mesh = Mesh(dp=dp, tp=tp, ep=2, rank=rank % 2, tp_group=pair if tp > 1 else None, ep_group=pair)
        apply_expert_parallel(model, resolved, mesh)
        seed = rank // tp  # a dp pair's ranks see tokens of their own, a tp pair's the same
        ids = torch.randint(0, model.config.vocab_size, (rows, SEQUENCE), generator=torch.Generator().manual_seed(seed))
        out[kind] = made_and_free(model, ids, microbatches, repeats, together, swaps_too=False)
    dist.destroy_process_group(pair)  # its threads would slow what calibrate measures next
    return out


def exchange_overheads(hardware, times: dict[str, dict]) -> dict[str, float]:
    """The profile's `call_overhead_s` `all_to_all` and `all_to_all_tp` from `ep_call_times`: for each, the time
    the all-to-alls took inside the layers (made against looped back) beyond their time alone (each priced as
    `hardware` prices an all-to-all of its bytes over 2 ranks), per exchange; never below 0."""
    from ..estimate.collectives import collective_s

    out = {}
    for kind, found in times.items():
        alone = sum(collective_s(hardware, "all_to_all", nbytes, 2, hardware.intra_node) for nbytes in found["swaps"])
        out[kind] = max((found["real"] - found["free"] - alone) / max(len(found["swaps"]), 1), 0.0)
    return out
