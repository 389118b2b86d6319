"""Tensor-parallel rewriting of LLaMA-family models against a single-process reference."""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from rewrite import ColumnParallelLinear, RowParallelLinear
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.collectives import CountCollectives
from tests.multiproc import run
from tests.reference import assert_grads_match

PLANS = {2: "plans/llama-tp2.yaml", 4: "plans/llama-tp4.yaml"}


def _check_model(rank: int, ws: int, preset: str, overrides: dict, count_collectives: bool) -> dict:
    tag = f"{preset}{overrides} tp={ws}"
    config = build_config(preset, **overrides)
    model = build_model(config, seed=1)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    labels = torch.randint(0, config.vocab_size, (2, 12), generator=gen)

    linear_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "proj" in n and n.endswith("weight")
    )
    stage = rewrite.apply_plan(model, PLANS[ws])
    assert stage.is_first and stage.is_last and stage.model is model, tag
    sharded = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(sharded) == 7 * config.num_hidden_layers, f"{tag}: {len(sharded)} sharded linears"
    # Parameter names are unchanged by the rewrite.
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()], tag
    # Per-rank memory of the sharded linears is 1/tp of the original.
    shard_bytes = sum(m.weight.numel() * m.weight.element_size() for m in sharded)
    assert shard_bytes * ws == linear_bytes, f"{tag}: {shard_bytes} * {ws} != {linear_bytes}"

    # Forward: logits and loss; backward: every gradient.
    with CountCollectives() as fwd:
        out = model(input_ids=ids, labels=labels)
    ref_out = reference(input_ids=ids, labels=labels)
    assert_close(f"{tag} logits", out.logits, ref_out.logits)
    assert_close(f"{tag} loss", out.loss, ref_out.loss)
    with CountCollectives() as bwd:
        out.loss.backward()
    ref_out.loss.backward()
    assert assert_grads_match(model, reference, prefix=f"{tag} ") > 0

    # Greedy generation with the KV cache gives the same tokens.
    prompt = ids[:1, :5]
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        ref_tokens = reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens), f"{tag}: generated {tokens.tolist()} != {ref_tokens.tolist()}"
    return {"forward": fwd.counts, "backward": bwd.counts} if count_collectives else {}


def _family(rank: int, ws: int, preset: str) -> list[dict]:
    torch.manual_seed(0)
    results = [_check_model(rank, ws, preset, {}, True)]
    if preset == "tiny-llama":
        variants = ({"attention_bias": True, "mlp_bias": True}, {"tie_word_embeddings": True})
        results += [_check_model(rank, ws, preset, v, False) for v in variants]
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_family_matches_reference(preset, world_size):
    results = run(_family, world_size, preset, timeout_s=180)
    layers = build_config(preset).num_hidden_layers
    counts = results[0][0]
    # Megatron's optimum: one all-reduce after attention and one after the MLP per layer,
    # and the mirror two in backward; never an all-gather.
    assert counts["forward"]["all_reduce"] == 2 * layers, counts
    extra = 2 if preset == "tiny-qwen3" else 0  # q_norm and k_norm see only this rank's heads
    assert counts["backward"]["all_reduce"] == (2 + extra) * layers, counts
    for phase in ("forward", "backward"):
        assert counts[phase]["all_gather"] == counts[phase]["all_gather_into_tensor"] == 0, counts
