"""`rewrite calibrate --model`: the layer terms fitted on a model's own decoder layers (its family's operators
beyond the matmuls), refused on every model that cannot be read or timed here before any rank starts."""

from __future__ import annotations

import yaml

from rewrite.estimate.hardware import Hardware
from rewrite.run.calibrate import calibrate, profile_yaml
from rewrite.run.calibrate_layers import (LAYER_MODEL, ROWS, SEQUENCE, fit_layers, layer_model_problem, layer_timings,
                                         taking_turns, with_layers)
from rewrite.run.flag_words import in_flags
from rewrite.run.presets import build_config
from tests.unit.run.test_cli import rewrite_cmd

BIG = "tests/configs/llama-3.1-8b.json"


def test_models_too_large_or_unknown_are_refused_in_the_callers_words():
    assert layer_model_problem("bench-qwen3-moe") is None and layer_model_problem(LAYER_MODEL) is None
    assert layer_model_problem("tests/configs/smollm2-135m.json") is None  # a config file at sizes this machine runs
    big = layer_model_problem(BIG)
    assert "218 M parameters is too large to time here (at most 30 M)" in big and "smaller sizes" in big
    assert in_flags(big).startswith(f"--model {BIG}: a decoder layer")
    assert "neither a preset" in layer_model_problem("no-such-model")
    for model in (BIG, "no-such-model"):  # before any rank starts: the command fails at once, naming the flag
        out = rewrite_cmd("calibrate", "--model", model, "--no-compile")
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.startswith("error: ") and model in out.stderr
    try:
        calibrate(2, model=BIG)
    except ValueError as exc:
        assert "too large to time here" in str(exc)
    else:
        raise AssertionError("calibrate timed a layer of 218 M parameters")


def test_the_layers_are_cut_with_their_types():
    config = build_config("tiny-qwen3", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    one = with_layers(config, 1)
    assert one.num_hidden_layers == 1 and one.layer_types == ["full_attention"]
    assert config.num_hidden_layers == 4 and len(config.layer_types) == 4  # a copy: the caller's config as it was


def test_a_family_layer_is_fitted_and_the_profile_names_it():
    timed = layer_timings(1, model="tiny-qwen3-moe")
    assert set(timed) == {"times"}  # not 'selective_layer_s': the estimate has no 'selective' for MoE layers
    assert set(timed["times"]) == {(rows, n) for rows in ROWS + (16,) for n in (1, 3)}
    found = fit_layers([timed["times"]], 1e10, 1e10, model="tiny-qwen3-moe")
    assert set(found) == {"layer_overhead_s", "activation_bandwidth", "microbatch_overhead_s", "layer_times",
                          "large_microbatch"}
    assert found["layer_overhead_s"] >= 0 and found["microbatch_overhead_s"] >= 0 and len(found["layer_times"]) == 5
    assert found["large_microbatch"]["tokens"] == 1024 and found["large_microbatch"]["ratio"] > 0  # 2,048 on 1,024
    terms = {"flops": {"float32": 5e10}, "memory_bandwidth": 2e10, "latency": 1e-4, "link": 2e9, "collective": 0.6,
             "memory_gib": 12.0, "world": 2, "measured": {"p2p": {4: 1e-4}, "all_reduce": {4: 2e-4}},
             "layer_model": "tiny-qwen3-moe", "layer_overhead_s": found["layer_overhead_s"]}
    text = profile_yaml(terms)
    assert "(tiny-qwen3-moe: 3 layers against 1 on 1-8 sequences of 128 tokens, fitted)" in text
    assert Hardware.model_validate(yaml.safe_load(text)).layer_overhead_s == float(f"{found['layer_overhead_s']:.3g}")
    assert f"({LAYER_MODEL}: 3 layers" in profile_yaml({k: v for k, v in terms.items() if k != "layer_model"})


def _timings(fixed: float, per_token: float, outside: float) -> dict:
    """A model's times as `layer_timings` gives them, of layers costing `fixed` + `per_token` x tokens each."""
    layer = {rows: fixed + per_token * rows * SEQUENCE for rows in ROWS + (16,)}
    return {(rows, n): outside + n * layer[rows] for rows in layer for n in (1, 3)}


def test_the_fit_recovers_the_terms_and_a_noisy_rank_moves_none():
    from rewrite.estimate.layer_activations import Sizes, layer_bytes
    from rewrite.models.flops import layer_flops
    from rewrite.run.presets import build_model, load_config

    config = build_model(with_layers(load_config(LAYER_MODEL), 1), device="meta").config
    flops = 3 * layer_flops(config, seq_len=SEQUENCE) / SEQUENCE  # a token's FLOPs in F, I and W
    moved = 5 * layer_bytes(Sizes.of(config, seq_len=SEQUENCE, batch_size=1), attention_split=False,
                            mlp_split=False, shared_split=False)[0] / SEQUENCE  # and its activation bytes
    rate, bandwidth = 5e10, 2e9
    per_token = flops / rate + moved / bandwidth
    clean = _timings(0.002, per_token, 0.03)
    found = fit_layers([clean], rate, 2e10)
    assert abs(found["layer_overhead_s"] - 0.002) < 1e-9 and abs(found["activation_bandwidth"] / bandwidth - 1) < 1e-6
    assert abs(found["large_microbatch"]["ratio"] - 1) < 0.05  # the same cost per token at 2,048 tokens: about 1
    noisy = {key: t * (1.3 if key[0] == 8 else 0.8) for key, t in clean.items()}  # one rank slowed at one size
    assert fit_layers([clean, noisy, clean], rate, 2e10) == found  # each size's median: the noisy rank moves nothing
    assert fit_layers([_timings(0.002, 0.8 * flops / rate, 0.03)], rate, 2e10)["activation_bandwidth"] is None
    # faster than the FLOPs alone: not resolved (priced at the memory's bandwidth), and so past a large copy's
    assert fit_layers([_timings(0.002, flops / rate + moved / 4e10, 0.03)], rate, 2e10)["activation_bandwidth"] is None


def test_sizes_are_timed_taking_turns():
    calls = []
    times = taking_turns({key: (lambda key=key: calls.append(key)) for key in "abc"}, 3)
    assert calls == list("abc") * 4 and set(times) == set("abc")  # a round untimed, then 3 each, in turn
    rounds = []
    taking_turns({"a": lambda: None}, 2, together=lambda: rounds.append(1))
    assert len(rounds) == 3  # `together` before every call
