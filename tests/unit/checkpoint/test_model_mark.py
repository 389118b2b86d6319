"""A training state's mark tells the model it was written for from another of the same shapes."""

from __future__ import annotations

from rewrite.checkpoint.model_mark import MARK_FILE, model_change, model_mark, write_mark
from tests.families import tiny_family_model


def test_another_class_or_configuration_is_named_and_runtime_settings_are_not(tmp_path):
    llama = tiny_family_model("llama")
    write_mark(tmp_path, llama)
    assert model_change(tmp_path, tiny_family_model("llama", seed=1)) is None  # other weights: the same model
    mistral = tiny_family_model("mistral", sliding_window=None)
    assert sorted(p.shape for p in mistral.parameters()) == sorted(p.shape for p in llama.parameters())
    assert model_change(tmp_path, mistral) == "LlamaForCausalLM (llama) -> MistralForCausalLM (mistral)"
    rope = tiny_family_model("llama", rope_theta=500000.0)
    assert "LlamaForCausalLM (llama) with another configuration (" in model_change(tmp_path, rope)
    assert "500000.0" in model_change(tmp_path, rope)
    runtime = tiny_family_model("llama")
    runtime.config.use_cache, runtime.config.output_hidden_states = True, True
    assert model_change(tmp_path, runtime) is None


def test_a_state_without_a_mark_loads_and_a_damaged_one_is_named(tmp_path):
    llama = tiny_family_model("llama")
    assert model_change(tmp_path, llama) is None  # written before marks existed
    (tmp_path / MARK_FILE).write_text("{not json")
    assert f"its {MARK_FILE} cannot be read" in model_change(tmp_path, llama)


def test_the_class_is_the_model_s_own_under_fsdp2_s():
    import torch.distributed.fsdp as fsdp

    llama = tiny_family_model("llama")
    wrapped = type(f"FSDP{type(llama).__name__}", (fsdp.FSDPModule, type(llama)), {})  # what fully_shard makes
    wrapped.__module__ = "torch.distributed.fsdp._fully_shard._fully_shard"
    llama.__class__ = wrapped
    assert model_mark(llama)["class"] == "LlamaForCausalLM"
