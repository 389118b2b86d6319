"""A compiled step under every composition against the model's own forward in one process.

Each case applies a plan with `compile` to a tiny LLaMA (or MoE), runs one step and checks the loss and every
gradient (1e-5), that no block broke its graph (each compiles with fullgraph: a break would have sent it to
eager, and dynamo's counters stay at zero) and that the blocks compiled a bounded number of graphs (the layers
share theirs). Most cases compile with `aot_eager` (dynamo and AOT autograd trace forward and backward, torch's
kernels run them): what the plan changes is the trace; inductor's code generation runs in cases of its own.
"""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rewrite
from tests.families import tiny_moe_model
from tests.multiproc import run
from tests.precision import check_bf16_step
from tests.reference import assert_replica_step

VOCAB = 128
EXPERTS = {"model.layers.*.mlp.experts": "expert_parallel"}
DISPATCH = "_dispatched"  # where a block holding experts split over ep is split (`expert_parallel.dispatch`)


def tiny(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def _plan(model, *, tp=1, pp=1, dp=1, cp=1, ep=1, sharding="full", sp=False, vocab=False, ac=None, schedule="1f1b",
          virtual=1, backend="aot_eager") -> dict:
    if ep > 1:
        data = {"tensor_parallel": EXPERTS}
    else:
        data = rewrite.plan_from_hf(model, tp=tp, pp=pp, microbatches=2, schedule=schedule, sequence_parallel=sp,
                                    virtual_stages=virtual, loss_parallel=vocab).model_dump(mode="json", exclude_none=True)
    data["mesh"] = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
    data["pipeline"] = {**data.get("pipeline", {}), "microbatches": 2}
    data["data_parallel"] = {"sharding": sharding}
    if vocab:
        data["tensor_parallel"]["model.embed_tokens"] = "vocab"
    if ac:
        data["activation_checkpointing"] = {"model.layers.*": ac}
    data["compile"] = {"backend": backend}
    return data


def _model(options: dict):
    if options.get("moe"):
        aux = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if options["moe"] == "qwen3_moe" else {}
        return tiny_moe_model(options["moe"], **aux)  # Qwen3-MoE with its routers' loss
    return tiny(4 if options.get("virtual", 1) > 1 else 2)


def _batch(model, dp: int, packed: bool) -> tuple[list, list]:
    """The global batch: 2 one-row microbatches of 16 tokens per replica; packed: two documents of 8 a row
    (positions restart)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2 * dp, 16), generator=gen)
    positions = torch.cat([torch.arange(8), torch.arange(8)]).expand(2 * dp, 16) if packed else None
    return rewrite.microbatches(ids, 2 * dp, position_ids=positions, labels=ids.roll(-1, 1))


def _case(name: str, options: dict) -> str:
    from torch._dynamo.utils import counters

    options = dict(options)
    graphs, split = options.pop("graphs", 3), options.pop("split", False)
    bf16, packed = options.pop("bf16", None), options.pop("packed", False)
    torch._dynamo.reset()
    counters.clear()
    model = _model(options)
    options.pop("moe", None)
    reference = copy.deepcopy(model)
    plan = _plan(model, **options)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if bf16:  # the recipe: compiled in bfloat16 against one process in bfloat16, at its tolerance
            ids, targets = _batch(model, plan["mesh"]["dp"], packed)
            check_bf16_step(model, plan, bf16, ids, targets, name)
            stage = None
        else:
            stage = rewrite.apply_plan(model, plan)
            assert stage.compiled, name
            ids, targets = _batch(model, stage.dp, packed)
            assert_replica_step(stage, model, reference, ids, targets, name)
    said = [str(w.message) for w in seen if str(w.message).startswith("compile:")]
    broke = [f.where for f in _forwards(stage) if f.broke] if stage is not None else said
    assert not broke and not said, f"{name}: ran eagerly: {broke} {said}"
    reasons = dict(counters["graph_break"])
    if split:  # experts split over ep: each of their layers split on purpose at the token exchange, nowhere else
        assert reasons and all(DISPATCH in reason for reason in reasons), f"{name}: graph breaks {reasons}"
    else:
        assert not reasons, f"{name}: {sum(reasons.values())} graph breaks: {reasons}"
    assert 1 <= counters["stats"]["unique_graphs"] <= graphs, (name, dict(counters["stats"]))
    return name


def _forwards(stage):
    from rewrite.compiled import CompiledForward

    for path in stage.compiled:
        forward = stage.model.get_submodule(path).forward
        while not isinstance(forward, CompiledForward):
            forward = forward.__wrapped__
        yield forward


# One graph per kind of block: the embedding, the layers (sharing theirs), the head; under sp the first layer
# also sees the whole sequence (one more graph, for that shape); a mixture of experts' layers differ.
WORLD2 = {
    "tp2": {"tp": 2},
    "tp2 sp vocab loss-parallel": {"tp": 2, "sp": True, "vocab": True},
    "tp2 full checkpointing": {"tp": 2, "ac": "full"},
    "tp2 selective checkpointing": {"tp": 2, "ac": "selective"},
    "pp2 1f1b": {"pp": 2},
    "pp2 zbv": {"pp": 2, "schedule": "zbv", "virtual": 2},
    "pp2 zero-bubble checkpointing": {"pp": 2, "schedule": "zero-bubble", "ac": "full"},
    "dp2 full": {"dp": 2},
    "dp2 replicate": {"dp": 2, "sharding": "replicate"},
    "cp2": {"cp": 2},
    "tp2 packed documents": {"tp": 2, "packed": True},
    "cp2 packed documents": {"cp": 2, "packed": True, "graphs": 4},  # layer 0 builds the masks, the rest read them
    "tp2 bf16 (autocast)": {"tp": 2, "bf16": "autocast"},
    "dp2 full bf16 (FSDP2 mixed precision)": {"dp": 2, "bf16": "fsdp"},
    "moe dp2": {"moe": "qwen3_moe", "dp": 2, "graphs": 8},
    "moe dp2 ep2, split at the exchange": {"moe": "qwen3_moe", "dp": 2, "ep": 2, "split": True, "graphs": 12},
    "latent attention tp2": {"moe": "deepseek_v2", "tp": 2, "graphs": 8},
    "tp2 sp inductor": {"tp": 2, "sp": True, "backend": "inductor", "graphs": 4},
}
WORLD4 = {
    "tp2 x pp2 1f1b": {"tp": 2, "pp": 2},
    "dp2 full x tp2 sp": {"dp": 2, "tp": 2, "sp": True, "graphs": 4},
    "cp2 x tp2 checkpointing": {"cp": 2, "tp": 2, "ac": "full"},
    "tp4 kv replicated": {"tp": 4},
}


def _world(rank: int, world: int, cases: dict) -> list[str]:
    return [_case(name, options) for name, options in cases.items()]


def test_every_composition_on_two_ranks_compiles_whole_and_matches_one_process():
    assert run(_world, 2, WORLD2, timeout_s=600)[0] == list(WORLD2)


def test_compositions_on_four_ranks_compile_whole_and_match_one_process():
    assert run(_world, 4, WORLD4, timeout_s=600)[0] == list(WORLD4)


def _trains(rank: int, world: int, tmp: str) -> dict:
    from pathlib import Path

    import yaml

    from rewrite.run.train import TrainConfig, train
    from tests.paths import ROOT

    tmp = Path(tmp)
    plan = tmp / "tp2-compiled.yaml"
    if rank == 0:
        data = yaml.safe_load((ROOT / "plans/llama-tp2.yaml").read_text())
        plan.write_text(yaml.safe_dump({**data, "compile": {"backend": "aot_eager"}}))
    torch.distributed.barrier()
    settings = {"batch_size": 2, "seq_len": 32, "progress": False, "lr": 1e-3}
    compiled = train(TrainConfig(str(plan), steps=3, parity=True, out_dir=str(tmp / "c"), **settings))
    eager = train(TrainConfig(str(plan), steps=3, compile=False, out_dir=str(tmp / "e"), **settings))
    # A state written compiled, resumed eagerly: the step after it is the compiled run's.
    train(TrainConfig(str(plan), steps=2, ckpt=str(tmp / "ckpt"), out_dir=str(tmp / "c2"), **settings))
    resumed = train(TrainConfig(str(plan), steps=3, ckpt=str(tmp / "ckpt"), resume=True, compile=False,
                                out_dir=str(tmp / "e2"), **settings))
    return {"parity": compiled["parity"], "compiled": compiled["losses"], "eager": eager["losses"],
            "resumed": resumed["losses"]}


def test_train_compiled_matches_eager_and_its_states_resume_eagerly(tmp_path):
    found = run(_trains, 2, str(tmp_path), timeout_s=300)[0]
    assert found["parity"]["max_dloss"] < 1e-5 and found["parity"]["max_dgrad"] < 1e-5, found["parity"]
    assert found["parity"]["num_params"] == found["parity"]["total_params"], found["parity"]
    assert max(abs(a - b) for a, b in zip(found["compiled"], found["eager"])) < 1e-5, found
    assert len(found["resumed"]) == 1 and abs(found["resumed"][0] - found["compiled"][2]) < 1e-5, found
