"""Multi-head latent attention (DeepSeek's MLA) split over tp 2, against one process: the loss, every
gradient and the gradient norm. Its kv_a projection is kept whole, the rotary key's gradient summed over tp
(`mla_kv_a`, Hugging Face's `mla_kv_a_proj`); its latent projections and norms get whole gradients with no
sum (DeepSeek-V2-Lite's shape, q_proj split and no q latent, too); under sequence parallelism (15 tokens: the
last part padded) the latents' gradients are summed instead. A Hugging Face save of the split model loads in
plain transformers, and back under the plan, as exactly its weights."""

from __future__ import annotations

import rewrite
from tests.distributed.expert_parallel.resume import matches, saved_weights
from tests.families import tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_step_and_norm

ATTENTION = {"model.layers.*.self_attn.q_b_proj": "column", "model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a",
             "model.layers.*.self_attn.kv_b_proj": "column", "model.layers.*.self_attn.o_proj": "row"}


def _cases(rank: int, world: int, root: str) -> list[str]:
    out = []
    model = tiny_moe_model("deepseek_v2")
    plan = rewrite.plan_from_hf(model, tp=2, microbatches=2)
    assert plan.tensor_parallel["model.layers.*.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a"
    stage, _, loss = assert_step_and_norm(model, plan, 12, "deepseek_v2 tp2")
    out.append(f"deepseek_v2 tp2: {float(loss):.5f}")
    rewrite.save_pretrained(stage, plan, f"{root}/hf")
    weights = saved_weights(root)
    matches("the Hugging Face save", stage.model, weights)
    matches("from_pretrained under tp 2", rewrite.from_pretrained(f"{root}/hf", plan).model, weights)

    lite = tiny_moe_model("deepseek_v2", q_lora_rank=None)  # q_proj split, kv_a_layernorm whole and not summed
    for sequence in (False, True):
        plan = rewrite.plan_from_hf(lite, tp=2, microbatches=2, sequence_parallel=sequence)
        _, _, loss = assert_step_and_norm(tiny_moe_model("deepseek_v2", q_lora_rank=None), plan, 15,
                                          f"deepseek_v2 lite tp2 sp={sequence}")
        out.append(f"deepseek_v2 lite tp2 sp={sequence}: {float(loss):.5f}")

    # DeepSeek-V3's own plan leaves the attention whole: split it too, experts by ep over the tp pair, SP.
    model = tiny_moe_model("deepseek_v3")
    plan = rewrite.plan_from_hf(model, tp=2, ep=2, microbatches=2, sequence_parallel=True).model_dump()
    plan["tensor_parallel"].update(ATTENTION)
    _, _, loss = assert_step_and_norm(model, plan, 15, "deepseek_v3 tp2 ep2 sp")
    out.append(f"deepseek_v3 tp2 ep2 sp: {float(loss):.5f}")
    return out


def test_latent_attention_split_over_tp(tmp_path):
    print(run(_cases, 2, str(tmp_path), timeout_s=300)[0])
