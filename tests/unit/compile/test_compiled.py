"""`compile` in one process: the plan section, which blocks a plan compiles, the fallback to eager when a block
cannot be traced whole, the train flags and the cache directory."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import rewrite
from rewrite import PlanError
from rewrite.compiled import CompiledForward, block_paths, compile_cache_dir, use_compile_cache
from rewrite.plan.schema import Compile
from rewrite.run.show.data import show_data
from rewrite.run.show.report import render_text
from rewrite.run.train_setup import compile_plan
from tests.models import ToyNet


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False))


def test_the_plan_section_takes_a_switch_or_options_and_refuses_the_rest(tmp_path):
    assert rewrite.load_plan({"compile": True}).compile == Compile()
    assert rewrite.load_plan({"compile": False}).compile is None and rewrite.load_plan({}).compile is None
    plan = rewrite.load_plan({"compile": {"mode": "max-autotune", "dynamic": True}})
    assert (plan.compile.backend, plan.compile.mode, plan.compile.dynamic) == ("inductor", "max-autotune", True)
    assert rewrite.load_plan(yaml.safe_load(plan.to_yaml())) == plan
    for bad, words in [({"mode": "fast"}, "mode"), ({"backend": "cudagraphs"}, "backend"), ({"fullgraph": False}, "fullgraph"),
                       ({"dynamic": "yes"}, "dynamic"), ("yes", "compile")]:
        with pytest.raises(PlanError, match=words):
            rewrite.load_plan({"compile": bad})
    path = tmp_path / "plan.yaml"
    path.write_text("mesh: {tp: 1}\ncompile:\n  mode: fast\n")
    with pytest.raises(PlanError, match="line 3"):  # the plan file's line, as every refusal names it
        rewrite.load_plan(path)


def test_a_decoder_compiles_its_embedding_each_layer_and_its_head():
    resolved = rewrite.resolve({"compile": True}, tiny())
    assert block_paths(resolved) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    toy = rewrite.resolve({"compile": True, "mesh": {"pp": 2}}, ToyNet(), world_size=2)
    assert block_paths(toy) == [m for stage in toy.stages for m in stage.modules]


class _Breaks(nn.Module):
    def forward(self, x):
        y = x * 2
        torch._dynamo.graph_break()  # what a model's own untraceable code does to the graph
        return y + 1


def test_a_block_that_breaks_its_graph_runs_eagerly_after_one_warning():
    from rewrite import compiled

    compiled._WARNED.clear()
    first, second = _Breaks(), _Breaks()
    for module in (first, second):
        module.forward = CompiledForward(module.forward, Compile(backend="eager"), where=f"Toy's {id(module)}")
    x = torch.arange(4.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert torch.equal(first(x), x * 2 + 1) and torch.equal(first(x), x * 2 + 1)
        assert torch.equal(second(x), x * 2 + 1)
    said = [str(w.message) for w in seen if "compile:" in str(w.message)]
    assert len(said) == 1 and "runs eagerly" in said[0] and f"Toy's {id(first)}" in said[0], said
    assert first.forward.broke and second.forward.broke


def test_a_block_that_traces_whole_runs_compiled_with_the_same_result():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny()
    layer = model.model.layers[0]
    hidden = torch.randn(1, 8, 32)
    position = model.model.rotary_emb(hidden, torch.arange(8)[None])
    want = layer(hidden, position_embeddings=position)
    layer.forward = CompiledForward(layer.forward, Compile(backend="aot_eager"), where="layer 0")
    got = layer(hidden, position_embeddings=position)
    assert torch.allclose(got, want, atol=1e-6) and layer.forward.broke is None
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_every_layer_of_a_deep_model_shares_one_graph_and_a_kv_cache_runs_eagerly():
    """Past torch's recompile limit (8 graphs a function): the layers of a real model must share theirs."""
    from torch._dynamo.utils import counters

    from rewrite import compiled
    from rewrite.compiled import apply_compile

    torch._dynamo.reset()
    counters.clear()
    compiled._WARNED.clear()
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=12, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    eager = LlamaForCausalLM(LlamaConfig(**config))
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(eager.state_dict())
    apply_compile(model, rewrite.resolve({"compile": {"backend": "aot_eager"}}, model))
    ids = torch.arange(8)[None]
    want = eager(input_ids=ids, use_cache=False).logits
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = model(input_ids=ids, use_cache=False).logits  # as a step runs the layers: no cache
        assert not [w for w in seen if "compile:" in str(w.message)]
        # transformers makes a KV cache unless told not to: each layer would read its own slot of it, a graph each.
        cached = model(input_ids=ids).logits
        model(input_ids=ids)
    said = [str(w.message) for w in seen if "compile:" in str(w.message)]
    assert len(said) == 1 and "when given a KV cache (pass use_cache=False" in said[0], said
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(cached, want, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]  # embedding, a layer, the head
    assert all(model.get_submodule(p).forward.broke is None for p in ("model.embed_tokens", "model.layers.11"))


def test_a_block_past_the_recompile_limit_runs_eagerly_after_one_warning():
    from rewrite import compiled

    torch._dynamo.reset()
    compiled._WARNED.clear()
    block = CompiledForward(lambda x: x * 2, Compile(backend="eager", dynamic=False), where="Toy's block")
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in range(1, 5):  # a graph per shape, static: the third is one too many
            assert torch.equal(block(torch.ones(n)), torch.full((n,), 2.0))
    said = [str(w.message) for w in seen if "compile:" in str(w.message)]
    assert len(said) == 1 and "Toy's block" in said[0] and "runs eagerly" in said[0] and block.broke, said


def test_a_block_whose_tracing_fails_without_a_message_still_runs_eagerly():
    from torch._dynamo.exc import Unsupported

    from rewrite import compiled

    compiled._WARNED.clear()
    block = CompiledForward(lambda x: x * 2, Compile(backend="eager"), where="Toy's silent block")

    def silent(*args, **kwargs):
        raise Unsupported("")

    block.compiled = silent
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert torch.equal(block(torch.ones(2)), torch.full((2,), 2.0))
    said = [str(w.message) for w in seen if "compile:" in str(w.message)]
    assert block.broke == "Unsupported" and len(said) == 1 and "(Unsupported)" in said[0], said


def test_train_flags_switch_the_plan_compile_on_and_off():
    eager, compiled = rewrite.load_plan({}), rewrite.load_plan({"compile": {"backend": "aot_eager"}})
    flags = lambda value: SimpleNamespace(compile=value)  # noqa: E731
    assert compile_plan(flags(None), eager) is eager and compile_plan(flags(None), compiled) is compiled
    assert compile_plan(flags(True), eager).compile == Compile()
    assert compile_plan(flags(True), compiled).compile.backend == "aot_eager"  # the plan's options kept
    assert compile_plan(flags(False), compiled).compile is None


def test_the_cache_lives_in_the_users_cache_directory_unless_told(monkeypatch, tmp_path):
    from rewrite.torch_internals import inductor_default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_default_cache_dir())  # what inductor sets by itself
    assert compile_cache_dir() == tmp_path / "xdg" / "rewrite" / "compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"
    assert use_compile_cache(tmp_path / "given") == tmp_path / "given" and (tmp_path / "given").is_dir()
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "given")


def test_show_says_what_is_compiled():
    resolved = rewrite.resolve({"compile": {"backend": "aot_eager"}}, tiny())
    data = show_data(resolved, tiny())
    assert data["compile"]["blocks"] == ["model.embed_tokens", "model.layers.0-1", "lm_head"]
    assert "Compiled: each of model.embed_tokens, model.layers.0-1, lm_head on its own under torch.compile " \
           "(aot_eager" in " ".join(render_text(data).split())
    assert show_data(rewrite.resolve({}, tiny()), tiny())["compile"] is None
