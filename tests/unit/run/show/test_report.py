"""`rewrite show` on real configs: collapsed layers, wrapped lists, memory per rank with activations, JSON."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

import rewrite
from rewrite.estimate.activations import rank_activations
from rewrite.estimate.memory import GIB, rank_memory, with_run
from rewrite.run.show.columns import format_bytes
from rewrite.plan.wording import index_ranges
from rewrite.run.show.report import format_plan, render_text, shard_rows
from rewrite.run.show.data import collapse_names, show_data, tp_entries
from rewrite.run.cli import main
from rewrite.run.presets import build_model, load_config
from tests.paths import PLANS, ROOT

LLAMA_8B = str(ROOT / "tests" / "configs" / "llama-3.1-8b.json")


@pytest.fixture(scope="module")
def llama_8b():
    return build_model(load_config(LLAMA_8B), device="meta")


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny-llama", device="meta")


def _show(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["show", *argv])
    return code, out.getvalue()


def _memory_rows(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "stages"])
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("  ") or not line.split()[0].isdigit():
            break
        rows[line.split()[0]] = line
    return rows


def test_index_ranges_are_numeric_and_compact():
    assert index_ranges([11, 0, 1, 2, 3, 8, 9, 10], min_run=2) == "0-3, 8-11"
    assert index_ranges([10, 9, 2], min_run=2) == "2, 9-10"  # 10 after 9, not after 1
    assert index_ranges([10, 9, 2]) == "2, 9, 10"  # messages: a range from three on
    assert index_ranges([5], min_run=2) == "5" and index_ranges([]) == ""
    names = [f"model.layers.{i}.mlp" for i in (10, 9, 2, 3)] + ["model.norm", "lm_head"]
    assert collapse_names(names) == ["model.layers.{2-3, 9-10}.mlp", "model.norm", "lm_head"]
    assert collapse_names(["model.embed_tokens", "model.layers.0", "model.layers.1"]) == [
        "model.embed_tokens", "model.layers.0-1",
    ]


def test_llama_8b_tensor_parallel_rows_collapse(llama_8b):
    resolved = rewrite.resolve(PLANS / "llama-tp2-pp2.yaml", llama_8b)
    rows = shard_rows(tp_entries(resolved, llama_8b))
    assert len(resolved.shards) == 224 and len(rows) == 7
    assert rows[0] == ["model.layers.0-31.self_attn.q_proj", "column", "[4096, 4096] -> [2048, 4096]", "-",
                       "model.layers.*.self_attn.q_proj"]
    text = format_plan(resolved, model=llama_8b)
    assert "\n  model.layers.0-31.mlp.down_proj     row     [4096, 14336] -> [4096, 7168]  model.layers.*.mlp.down_proj\n" in text
    # Stages name their layers as ranges.
    first = resolved.layer_indices[1][0]
    assert f"model.rotary_emb, model.layers.{first}-31, model.norm, lm_head\n" in text


@pytest.mark.parametrize("plan", ["llama-tp2-pp2", "llama-dp2-tp2-pp2", "llama-pp2-zbv", "llama-tp2-sp", "llama-tp4"])
def test_no_line_over_120_columns_on_the_8b_config(plan):
    code, text = _show(str(PLANS / f"{plan}.yaml"), "--model", LLAMA_8B, "--memory-limit", "40")
    assert code == 0
    assert max(len(line) for line in text.splitlines()) <= 120, max(text.splitlines(), key=len)
    assert len(text.splitlines()) < 80  # 7 tp rows, not 224


def test_a_long_module_list_wraps(llama_8b):
    text = format_plan(rewrite.resolve(PLANS / "llama-tp2-sp.yaml", llama_8b), model=llama_8b)
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if "model.embed_tokens, model.rotary_emb, model.layers.0-31," in line)
    assert lines[i + 1].strip() == "lm_head" and lines[i + 1].startswith(" " * 20)


def test_memory_against_a_hand_computation(tiny):
    # tiny-llama: h 64, 8 heads of 8, 4 kv heads, i 128, V 256, 4 layers; tp=2 halves q/k/v/o, gate/up/down.
    resolved = rewrite.resolve(PLANS / "llama-tp2-pp2.yaml", tiny)  # afab, 4 microbatches
    layer = 2048 + 1024 + 1024 + 2048 + 3 * 4096 + 2 * 64  # q, k, v, o, gate/up/down, 2 norms per tp rank
    params = [256 * 64 + 2 * layer, 2 * layer + 64 + 256 * 64]  # stage 0: embeddings; stage 1: norm, head
    run = {"batch_size": 2, "seq_len": 128, "microbatches": 6}
    ranks = rank_memory(resolved, tiny, **run)
    acts = rank_activations(with_run(resolved, seq_len=128, microbatches=6), tiny, batch_size=2)
    assert [m.rank for m in ranks] == [0, 1, 2, 3]
    for m in ranks:
        n = params[m.pp_rank]
        assert (m.params, m.weights, m.grads, m.adamw, m.gathered) == (n, 4 * n, 4 * n, 8 * n, 0)
        assert m.activations == acts[m.pp_rank].top and m.in_flight == 6  # the last stage: its loss's peak too
        assert m.total == 16 * n + m.activations
    # 1F1B keeps at most pp - r microbatches on rank r; AFAB all 6.
    one_f = rewrite.resolve({**rewrite.load_plan(PLANS / "llama-tp2-pp2.yaml").model_dump(), "pipeline": {
        "schedule": "1f1b", "microbatches": 4, "cut_points": ["model.layers.2"]}}, tiny)
    afab, ones = rank_memory(resolved, tiny, seq_len=128), rank_memory(one_f, tiny, seq_len=128)
    assert [m.in_flight for m in afab] == [4, 4, 4, 4] and [m.in_flight for m in ones] == [2, 2, 1, 1]
    assert afab[0].activations == 2 * ones[0].activations
    # The last stage's: its kept bytes 4 times over, its loss's peak once either way (after the last microbatch's F).
    loss = afab[2].activations - rank_activations(with_run(resolved, seq_len=128), tiny)[1].peak
    assert loss > 0 and afab[2].activations - loss == 4 * (ones[2].activations - loss)
    assert afab[0].weights == ones[0].weights


def test_memory_limit_marks_the_ranks_over_it(tiny):
    resolved = rewrite.resolve(PLANS / "llama-tp2-pp2.yaml", tiny)
    totals = [m.total for m in rank_memory(resolved, tiny)]
    limit = (min(totals) + max(totals)) / 2 / GIB
    code, text = _show(str(PLANS / "llama-tp2-pp2.yaml"), "--model", "tiny-llama", "--memory-limit", f"{limit:.6f}")
    assert code == 0  # informational: show still succeeds
    rows = _memory_rows(text)
    for rank, total in enumerate(totals):
        fits = total <= float(f"{limit:.6f}") * GIB
        assert rows[str(rank)].endswith("yes" if fits else f"{format_bytes(total)}  no (> {float(f'{limit:.6f}'):g} GiB)")
    over = sum(t > float(f"{limit:.6f}") * GIB for t in totals)
    assert f"  {over} of 4 ranks do not fit in " in text and over == 2


def test_json_matches_the_text(tiny):
    args = [str(PLANS / "llama-dp2-tp2-pp2.yaml"), "--model", "tiny-llama", "--seq-len", "256", "--memory-limit", "0.02"]
    code, out = _show(*args, "--json")
    assert code == 0
    data = json.loads(out)
    _, text = _show(*args)
    rows = _memory_rows(text)
    assert data["mesh"] == {"dp": 2, "pp": 2, "cp": 1, "tp": 2, "ep": 1, "world_size": 8} and data["experts"] == []
    assert data["pipeline"]["seq_len"] == 256 and data["pipeline"]["schedule"] == "1f1b"
    assert [e["module"] for e in data["tensor_parallel"]][:2] == ["model.layers.0-3.self_attn.q_proj", "model.layers.0-3.self_attn.k_proj"]
    assert data["stages"][1]["modules"] == ["model.rotary_emb", "model.layers.2-3", "model.norm", "lm_head"]
    assert data["warnings"] == []
    for entry in data["memory"]["ranks"]:
        cells = rows[str(entry["rank"])]
        assert f"{entry['params']:,}" in cells
        for key in ("weights", "grads", "adamw", "gathered", "activations", "total"):
            assert isinstance(entry[key], int) and format_bytes(entry[key]) in cells, key
        assert entry["total"] == sum(entry[k] for k in ("weights", "grads", "adamw", "gathered", "activations"))
        assert entry["fits"] == (entry["total"] <= 0.02 * GIB) and cells.endswith("yes") == entry["fits"]
    assert data["memory"]["not_fitting"] == sum(not e["fits"] for e in data["memory"]["ranks"])


def test_warnings_are_printed_and_passed_on(tiny):
    resolved = rewrite.resolve(PLANS / "llama-tp2-pp2.yaml", tiny)
    warnings = ["stage 1 holds 95% of the estimated compute"]
    text = format_plan(resolved, model=tiny, warnings=warnings)
    assert text.endswith("\n\nWarnings:\n  - stage 1 holds 95% of the estimated compute")
    assert "Warnings:" not in format_plan(resolved, model=tiny)
    assert show_data(resolved, tiny, warnings=warnings)["warnings"] == warnings


@pytest.mark.parametrize(("plan", "with_model", "run"), [
    ("llama-dp2-tp2-pp2", True, {"memory_limit": 0.02, "seq_len": 256, "warnings": ["stage 1 holds 95%"]}),
    ("llama-pp2-zbv", True, {"batch_size": 2, "microbatches": 6}),
    ("llama-tp2-sp", True, {"model_label": "tiny-llama"}),
    ("llama-tp2-pp2", False, {"memory_limit": 40}),
])
def test_the_text_needs_only_the_dict(tiny, plan, with_model, run):
    # Rendered from the dict after a JSON round trip (no resolved plan, no model, no tuples), the text is the same.
    model = tiny if with_model else None
    resolved = rewrite.resolve(PLANS / f"{plan}.yaml", tiny)
    data = show_data(resolved, model, **run)
    assert render_text(json.loads(json.dumps(data))) == render_text(data) == format_plan(resolved, model=model, **run)


def test_replicated_kv_heads_are_named_and_their_shapes_shown(tiny):
    # tiny-llama's 4 kv heads at tp 8: each kv head on 2 ranks, k_proj [32, 64] -> one head of 8 rows a rank.
    rules = dict(rewrite.load_plan(PLANS / "llama-tp4.yaml").tensor_parallel)
    resolved = rewrite.resolve({"mesh": {"tp": 8}, "tensor_parallel": rules}, tiny)
    data = show_data(resolved, tiny)
    assert data["kv_replicas"] == 2
    k_proj = next(e for e in data["tensor_parallel"] if e["module"] == "model.layers.0-3.self_attn.k_proj")
    assert (k_proj["weight"], k_proj["weight_per_rank"]) == ([32, 64], [8, 64])
    text = render_text(json.loads(json.dumps(data)))
    assert text == format_plan(resolved, model=tiny)
    assert "  model.layers.0-3.self_attn.v_proj  column  [32, 64] -> [8, 64]" in text
    assert ("kv heads replicated 2x: each of the 4 kv heads on 2 of the 8 tp ranks (tp ranks 0-1 hold kv head 0, "
            "ranks 2-3 kv head 1, ...)") in " ".join(text.split())  # unwrapped
    plain = show_data(rewrite.resolve(PLANS / "llama-tp4.yaml", tiny), tiny)
    assert plain["kv_replicas"] == 1 and "replicated" not in render_text(plain)


def test_show_on_the_8b_config_is_fast(llama_8b):
    _show(str(PLANS / "llama-tp2-pp2.yaml"), "--model", LLAMA_8B)  # imports and the first model build
    start = time.process_time()
    code, _ = _show(str(PLANS / "llama-tp2-pp2.yaml"), "--model", LLAMA_8B, "--memory-limit", "40")
    took = time.process_time() - start
    print(f"rewrite show on llama-3.1-8b, in process: {took:.3f} s")
    assert code == 0 and took < 4.0  # CPU seconds of this process; target 2 s


def test_the_fullest_line_reads_the_tables_run(tiny):
    # One microbatch reduces each layer's gradients as its backward leaves it (`reduce_as_run`): the fullest
    # rank under the plan's own sharding is then the table's peak without activations, not the plan's 4
    # microbatches' one.
    resolved = rewrite.resolve(PLANS / "llama-dp2-tp2-pp2.yaml", tiny)
    memory = show_data(resolved, tiny, microbatches=1, dtype="bfloat16")["memory"]
    sharding = resolved.plan.data_parallel.sharding
    table = max(m["total"] - m["activations"] for m in memory["ranks"])
    assert memory["fullest"][sharding]["peak"] == table
    planned = show_data(resolved, tiny, dtype="bfloat16")["memory"]
    assert planned["fullest"][sharding]["peak"] != table  # the run's microbatches matter here
