"""Tensor parallelism past the kv heads: each kv head held by tp / kv ranks.

Against one process: the step loss and every gradient (each rank's slice; a kv head's
holders all hold its full gradient), `model(...)` logits and `generate`, for grouped-query
(8 heads / 2 kv) and multi-query (8 / 1) attention, Qwen3's per-head norms, with sequence,
vocabulary and loss parallelism and activation checkpointing, under pipeline schedules and
FSDP2; a plan that splits a head is refused on every rank before anything runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import rewrite
from rewrite.run.parity import parity_check, reference_step
from tests.asserts import assert_close
from tests.multiproc import run
from tests.reference import assert_grads_match

VOCAB = 256
ALL_OPTIONS = {"sequence_parallel": True, "vocab": True, "loss_parallel": True, "activation_checkpointing": True}


def _plan(model, tp: int, options: dict, **pipeline) -> dict:
    """The model's own tp plan at `tp`, with the options asked for: vocab embedding, loss and
    sequence parallelism, activation checkpointing of every layer."""
    plan = rewrite.plan_from_hf(model, tp=tp, loss_parallel=options.get("loss_parallel", False),
                                sequence_parallel=options.get("sequence_parallel", False), **pipeline)
    data = plan.model_dump(mode="json", exclude_none=True)
    if options.get("vocab"):
        data["tensor_parallel"]["model.embed_tokens"] = "vocab"
    if options.get("activation_checkpointing"):
        data["activation_checkpointing"] = {"model.layers.*": "full"}
    return data


def tiny(family: str, kv: int, layers: int = 2) -> torch.nn.Module:
    """8 heads of 8, `kv` kv heads, hidden 64: seeded alike on every rank."""
    torch.manual_seed(0)
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=kv, head_dim=8, max_position_embeddings=64,
                          tie_word_embeddings=False)
    model = model_class(config).float()
    with torch.no_grad():  # off the constant initial norms, so per-head norm gradients differ by head
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def _batch(microbatches: int = 2, seq: int = 12) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (2, seq), generator=gen) for _ in range(microbatches)]
    return ids, [torch.randint(0, VOCAB, (2, seq), generator=gen) for _ in range(microbatches)]


def _whole(rank: int, world: int, cases: list) -> list[str]:
    """pp 1: one step, then model(...) and generate, each case against one process."""
    done = []
    for family, kv, options in cases:
        name = f"{family} 8/{kv} tp {world} {sorted(options)}"
        model = tiny(family, kv)
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, _plan(model, world, options))
        attention = model.model.layers[0].self_attn
        assert stage.mesh.kv_replicas == world // kv, name
        assert attention.k_proj.replicas == world // kv and attention.k_proj.slot == rank // (world // kv), name
        assert attention.num_key_value_groups == 8 // world, name  # its query heads per kv head
        ids, targets = _batch()
        loss = rewrite.run_schedule(stage, ids, targets)
        assert_close(f"{name} step loss", loss, reference_step(reference, ids, targets))
        assert assert_grads_match(model, reference, prefix=f"{name} ") > 0
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        with torch.no_grad():
            assert_close(f"{name} logits", model(input_ids=ids[0]).logits, reference(input_ids=ids[0]).logits)
            prompt = ids[0][:1, :5]  # then one token at a time through the KV cache (one kv head per rank)
            tokens = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
            expected = reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, expected), f"{name}: generate {tokens.tolist()} != {expected.tolist()}"
        done.append(name)
    return done


def test_past_the_kv_heads_at_tp4_matches_one_process():
    cases = [("llama", 2, {}), ("llama", 1, {}), ("qwen3", 2, {}), ("llama", 2, ALL_OPTIONS), ("qwen3", 1, ALL_OPTIONS)]
    done = run(_whole, 4, cases, timeout_s=300)
    assert all(len(d) == len(cases) for d in done), done


def test_multi_query_at_tp2_matches_one_process():
    done = run(_whole, 2, [("llama", 1, {}), ("llama", 1, ALL_OPTIONS)], timeout_s=180)
    assert all(len(d) == 2 for d in done), done


PIPELINES = {  # tp 4 x pp 2 (4 layers): every named schedule: plain, split backwards, virtual stages
    "afab": {"schedule": "afab", "microbatches": 2},
    "1f1b": {"schedule": "1f1b", "microbatches": 2},
    "zero-bubble": {"schedule": "zero-bubble", "microbatches": 2},
    "zbv": {"schedule": "zbv", "microbatches": 2, "virtual_stages": 2},
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "microbatches": 2, "virtual_stages": 2},
}


def _step_matches(name: str, model, plan: dict, microbatches: int = 2) -> None:
    """One step of `plan` on the global batch (each replica its share) equals one process's."""
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    ids, targets = _batch(microbatches)
    per = microbatches // stage.dp
    mine = slice(per * stage.dp_rank, per * (stage.dp_rank + 1))
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])  # the global batch's loss
    result = parity_check(model, reference, ids, targets, loss)
    assert result.max_dloss <= 1e-5 and result.max_dgrad <= 1e-5, f"{name}: {result}"
    assert result.num_params == result.total_params, f"{name}: {result}"


def _pipelined(rank: int, world: int) -> list[str]:
    for schedule, pipeline in PIPELINES.items():
        model = tiny("llama", 2, layers=4)
        options = ALL_OPTIONS if schedule == "1f1b" else {}
        _step_matches(schedule, model, _plan(model, 4, options, pp=2, **pipeline))
    return list(PIPELINES)


def test_tp4_by_pp2_under_each_kind_of_schedule():
    done = run(_pipelined, 8, timeout_s=420)
    assert done[0] == list(PIPELINES), done[0]


def _data_parallel(rank: int, world: int) -> list[str]:
    shardings = ["full", "grad_op", "replicate"]
    for sharding in shardings:
        model = tiny("qwen3", 2)
        plan = _plan(model, 4, {"sequence_parallel": True, "activation_checkpointing": True})
        plan = {**plan, "mesh": {"dp": 2, "tp": 4}, "data_parallel": {"sharding": sharding}}
        _step_matches(sharding, model, plan, microbatches=4)  # two microbatches per replica
    return shardings


def test_dp2_by_tp4_under_each_sharding():
    done = run(_data_parallel, 8, timeout_s=420)
    assert done[0] == ["full", "grad_op", "replicate"], done[0]


def _refused(rank: int, world: int) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    model = LlamaForCausalLM(config)
    with pytest.raises(rewrite.PlanError) as info:
        rewrite.apply_plan(model, rewrite.plan_from_hf(model, tp=4))
    return str(info.value)


def test_a_tp_that_splits_a_head_is_refused_on_every_rank():
    messages = run(_refused, 4, timeout_s=180)
    assert len(set(messages)) == 1, messages
    assert ("mesh.tp=4 does not divide num_attention_heads=6 (q_proj, k_proj, v_proj, o_proj would split a head); "
            "tp must divide the 6 attention heads and either divide the 2 kv heads (tp 1 or 2) or be a multiple of "
            "them, each kv head then replicated on tp / 2 ranks (tp 6)") in messages[0]
