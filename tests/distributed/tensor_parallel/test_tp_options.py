"""Vocabulary-parallel embedding and head, loss parallelism, sequence parallelism (and all of
them with activation checkpointing): the same logits, loss, gradients and generated
tokens as one process, at tp 2 and 4, pp 1 and 2.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.collectives import CountCollectives
from tests.multiproc import run
from tests.reference import assert_grads_match

LAYERS = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel
VOCAB = {"model.embed_tokens": "vocab"}
HEAD = {"lm_head": "column"}
OPTIONS = {
    "vocab": ({**VOCAB, "lm_head": "column_gather"}, {}),
    "loss_parallel": (HEAD, {"loss_parallel": True}),
    "sequence_parallel": ({}, {"sequence_parallel": True}),
    "all": ({**VOCAB, **HEAD}, {"loss_parallel": True, "sequence_parallel": True,
                                "activation_checkpointing": {"model.layers.*": "full"}}),
}


def _plan(tp: int, pp: int, option: str) -> dict:
    rules, switches = OPTIONS[option]
    pipeline = {"schedule": "1f1b", "microbatches": 3} if pp > 1 else {}
    return {"mesh": {"tp": tp, "pp": pp}, "tensor_parallel": {**LAYERS, **rules}, "pipeline": pipeline, **switches}


def _batch(vocab: int, tp: int) -> tuple[list, list]:
    """Three microbatches whose lengths tp divides and does not."""
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, vocab, (2, n), generator=gen) for n in (4 * tp, 4 * tp + 1, 3)]
    targets = [torch.roll(x, -1, dims=1) for x in ids]
    for t in targets:
        t[:, -1] = -100
    return ids, targets


def _whole_model(stage, model, reference, ids, name: str) -> None:
    """pp = 1: model(...) returns full logits; backward and generate match one process."""
    out, ref = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    assert_close(f"{name} logits", out.logits, ref.logits)
    assert out.logits.shape[-1] == model.config.vocab_size, name
    out.loss.backward()
    ref.loss.backward()
    assert assert_grads_match(model, reference, prefix=f"{name} model() ") > 0
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    with torch.no_grad():  # a 5-token prompt, then one-token steps through the KV cache
        tokens = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
        expected = reference.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, expected), f"{name}: generated {tokens.tolist()} != {expected.tolist()}"


def _case(tp: int, pp: int, option: str, tied: bool, preset: str = "tiny-llama") -> float:
    name = f"{preset} tp{tp} pp{pp} {option}{' tied' if tied else ''}"
    config = build_config(preset, tie_word_embeddings=tied)
    model = build_model(config, seed=4)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, _plan(tp, pp, option))
    ids, targets = _batch(config.vocab_size, tp)
    if pp == 1:
        _whole_model(stage, model, reference, ids[0], name)
    if tied and stage.is_first and stage.is_last:
        assert model.lm_head.weight is model.model.embed_tokens.weight, f"{name}: the tie was broken"
    loss = rewrite.run_schedule(stage, ids, targets)
    assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
    assert assert_grads_match(stage.module, reference, prefix=f"{name} ") > 0
    return float(loss)


def _matrix(rank: int, ws: int, tp: int, pp: int) -> list[float]:
    torch.manual_seed(0)
    out = [_case(tp, pp, option, False) for option in OPTIONS]
    if (tp, pp) == (2, 1):  # per-head q/k norms (Qwen3), attention biases (Qwen2)
        out += [_case(tp, pp, "all", False, preset) for preset in ("tiny-qwen3", "tiny-qwen2")]
    return out + [_case(tp, pp, "all", True)]


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_each_option_and_all_together_match_one_process(tp, pp):
    losses = run(_matrix, tp * pp, tp, pp, timeout_s=300)
    assert all(r == losses[0] for r in losses), losses  # every rank reports the same step losses


def _user_losses(rank: int, ws: int) -> dict:
    config = build_config("tiny-llama")
    model = build_model(config, seed=4)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, _plan(2, 1, "all"))
    ids, targets = _batch(config.vocab_size, 2)
    seen = {}

    @rewrite.returns_token_sums  # divided by the global batch's trained tokens, as the default loss
    def full_logits(logits, t):
        seen["full"] = logits.shape[-1]
        return rewrite.causal_lm_loss(logits, t, reduction="sum")

    @rewrite.takes_logit_shards
    @rewrite.returns_token_sums
    def on_shards(logits, t, shard):
        seen["shard"] = (logits.shape[-1], shard.start, shard.stop, shard.vocab_size)
        return rewrite.vocab_parallel_cross_entropy(logits, t, shard.group, vocab_start=shard.start, reduction="sum")

    expected = reference_step(reference, ids, targets)
    for fn in (full_logits, on_shards):
        model.zero_grad(set_to_none=True)
        assert_close(f"{fn.__name__} loss", rewrite.run_schedule(stage, ids, targets, loss_fn=fn), expected)
        assert assert_grads_match(model, reference, prefix=f"{fn.__name__} ") > 0
    return seen


def test_a_user_loss_gets_full_logits_unless_it_takes_shards():
    seen = run(_user_losses, 2, timeout_s=120)
    vocab = build_config("tiny-llama").vocab_size
    assert seen[0]["full"] == vocab
    assert seen[1]["shard"] == (vocab // 2, vocab // 2, vocab, vocab)


def _one_layer(rank: int, ws: int) -> dict:
    """The collectives of one decoder layer's forward under sequence parallelism."""
    config = build_config("tiny-llama")
    model = build_model(config, seed=4)
    rewrite.apply_plan(model, _plan(2, 1, "sequence_parallel"))
    layer, base = model.model.layers[1], model.model
    hidden = torch.randn(2, 5, config.hidden_size)  # this rank's tokens: 5 of a 10-token sequence
    positions = torch.arange(10).unsqueeze(0)
    rotary = base.rotary_emb(hidden, positions)
    with CountCollectives() as seen:
        out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    out = out[0] if isinstance(out, tuple) else out
    return {"counts": seen.made(), "shape": tuple(out.shape)}


def test_one_sequence_parallel_layer_gathers_twice_and_reduce_scatters_twice():
    for result in run(_one_layer, 2, timeout_s=120):
        assert result["counts"] == {"sequence_all_gather": 2, "sequence_reduce_scatter": 2}, result  # no all-reduce
        assert result["shape"] == (2, 5, build_config("tiny-llama").hidden_size), result


def _saved_tensors(rank: int, ws: int) -> dict:
    """Every option on, with and without recomputing the decoder layers: same gradients, fewer saved tensors."""
    config = build_config("tiny-llama")
    ids, targets = _batch(config.vocab_size, 2)
    counts, grads = {}, {}
    for recompute in (False, True):
        model = build_model(config, seed=4)
        plan = _plan(2, 1, "all")
        if not recompute:
            plan.pop("activation_checkpointing")
        stage = rewrite.apply_plan(model, plan)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            loss = rewrite.run_schedule(stage, ids, targets)
        counts[recompute] = len(saved)
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
        counts[f"loss {recompute}"] = float(loss)
    for name, grad in grads[False].items():
        assert_close(f"{name}.grad with and without recomputation", grads[True][name], grad)
    return counts


def test_recomputing_layers_saves_fewer_tensors_for_the_same_gradients():
    for counts in run(_saved_tensors, 2, timeout_s=120):
        assert 0 < counts[True] < counts[False] / 2, counts
        assert counts["loss True"] == counts["loss False"], counts
