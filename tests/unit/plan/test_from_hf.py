"""Plans from a Hugging Face model's own tp_plan: embeddings, tied heads, loss and sequence parallelism."""

from __future__ import annotations

import pytest

import rewrite
from rewrite import resolve
from rewrite.run.presets import build_config, build_model


def _declaring_embedding(**overrides):
    # A LlamaConfig whose own plan shards its embedding by vocabulary rows, as e.g.
    # HunYuanDenseV1Config and DiffLlamaConfig declare (the class attribute stays untouched).
    config = build_config("tiny-llama", **overrides)
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    return config


def test_embedding_rowwise_becomes_vocab():
    config = _declaring_embedding()
    plan = rewrite.plan_from_hf(config, tp=2)
    assert plan.tensor_parallel["model.embed_tokens"] == "vocab"
    assert plan.tensor_parallel["lm_head"] == "column_gather" and not plan.loss_parallel
    shards = {s.fqn: s for s in resolve(plan, build_model(config, device="meta")).shards}
    assert shards["model.embed_tokens"].style == "vocab"
    assert shards["model.embed_tokens"].weight_shape == (128, 64)  # 256 rows over 2 ranks
    # A real model declaring only its embedding (transformers' HunYuan dense).
    from transformers import HunYuanDenseV1Config

    assert rewrite.plan_from_hf(HunYuanDenseV1Config(), tp=2).tensor_parallel["model.embed_tokens"] == "vocab"


def test_loss_parallel_on_llama():
    config = build_config("tiny-llama")
    plan = rewrite.plan_from_hf(config, tp=2, loss_parallel=True)
    assert plan.loss_parallel and plan.tensor_parallel["lm_head"] == "column"
    assert "model.embed_tokens" not in plan.tensor_parallel  # untied: the embedding is the model's call
    resolved = resolve(plan, build_model(config, device="meta"))
    assert {s.fqn: s.style for s in resolved.shards}["lm_head"] == "column"
    both = rewrite.plan_from_hf(_declaring_embedding(), tp=2, loss_parallel=True, sequence_parallel=True)
    assert (both.tensor_parallel["model.embed_tokens"], both.tensor_parallel["lm_head"]) == ("vocab", "column")
    assert both.loss_parallel and both.sequence_parallel
    resolve(both, build_model("tiny-llama", device="meta"))
    with pytest.raises(ValueError, match="loss_parallel=True needs a causal LM with an LM head"):
        rewrite.plan_from_hf(build_model("tiny-llama", device="meta").model, tp=2, loss_parallel=True)


def test_tied_embeddings():
    tied = build_config("tiny-llama", tie_word_embeddings=True)
    model = build_model(tied, device="meta")
    # With loss_parallel both ends of the one matrix are split along the vocabulary alike.
    plan = rewrite.plan_from_hf(tied, tp=2, loss_parallel=True)
    assert (plan.tensor_parallel["model.embed_tokens"], plan.tensor_parallel["lm_head"]) == ("vocab", "column")
    styles = {s.fqn: s.style for s in resolve(plan, model).shards}
    assert (styles["model.embed_tokens"], styles["lm_head"]) == ("vocab", "column")
    # Without, both stay whole, even when the model declares a rule for its embedding.
    for config in (tied, _declaring_embedding(tie_word_embeddings=True)):
        plan = rewrite.plan_from_hf(config, tp=2)
        assert "lm_head" not in plan.tensor_parallel and "model.embed_tokens" not in plan.tensor_parallel
        assert len(resolve(plan, model).shards) == 28
