"""The tensor-parallel options table of `rewrite show` reads the memory table's estimate: each row is the
busiest rank of the memory table `show` prints for that row's plan, in the same compute dtype and run."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

import rewrite
from rewrite.run.cli import main
from rewrite.run.presets import build_model, load_config
from rewrite.run.show.data import show_data
from rewrite.run.show.options import format_options, option_memory
from rewrite.run.show.report import render_text
from tests.paths import PLANS, ROOT

# tiny-llama (float32 master weights, 4 layers, V 256) under a run that is not the plan's, so the run must reach
# every row; Llama-3.1-8B under the plan's run, where the busiest rank moves (stage 1 has more activations,
# stage 0 more weights and so more in total).
MODELS = {"tiny-llama": {"batch_size": 2, "seq_len": 32, "microbatches": 2},
          str(ROOT / "tests" / "configs" / "llama-3.1-8b.json"): {}}
VOCAB = {"model.embed_tokens": "vocab", "lm_head": "column"}
LAYERS = "model.layers.*"


@pytest.fixture(scope="module")
def models():
    return {name: build_model(load_config(name), device="meta") for name in MODELS}


def _plans() -> list[dict]:
    """llama-tp2-pp2.yaml as written (every switch off), and with every switch on."""
    off = rewrite.load_plan(PLANS / "llama-tp2-pp2.yaml").model_dump(mode="json", exclude_none=True)
    on = {**off, "tensor_parallel": {**off["tensor_parallel"], **VOCAB}, "loss_parallel": True,
          "sequence_parallel": True, "activation_checkpointing": {LAYERS: "full"}}
    return [off, on]


def _flipped(data: dict) -> dict[str, dict]:
    """The plan data with each switch flipped by hand, keyed by the options table's label for it."""
    lp, sp, ckpt = data.get("loss_parallel", False), data.get("sequence_parallel", False), data.get(
        "activation_checkpointing")
    rules = {p: s for p, s in data["tensor_parallel"].items() if p not in VOCAB}
    word = lambda on: "on" if on else "off"  # noqa: E731
    return {
        f"vocab + loss_parallel {word(not lp)}": {
            **data, "tensor_parallel": rules if lp else {**rules, **VOCAB}, "loss_parallel": not lp},
        f"sequence_parallel {word(not sp)}": {**data, "sequence_parallel": not sp},
        (f"activation_checkpointing on ({LAYERS})" if not ckpt else "activation_checkpointing off"): {
            **data, "activation_checkpointing": {} if ckpt else {LAYERS: "full"}},
    }


def _cells(text: str, first: str) -> list[dict[str, str]]:
    """The rows of the table whose header starts with `first`, as {column: cell}."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == [first])
    header = re.split(r"\s{2,}", lines[at].strip())
    rows = []
    for line in lines[at + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if not line.startswith("  ") or line.startswith("    ") or len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells)))
    return rows


def _memory_table(data: dict, model, dtype: str, run: dict) -> tuple[dict, dict[str, str]]:
    """What `show` prints for `data`: the busiest rank's memory entry (highest total, lowest rank) and its
    row of the memory table's text."""
    shown = show_data(rewrite.resolve(data, model), model, dtype=dtype, **run)
    top = max(shown["memory"]["ranks"], key=lambda m: (m["total"], -m["rank"]))
    row = next(r for r in _cells(render_text(shown), "rank") if r["rank"] == str(top["rank"]))
    return top, row


@pytest.mark.parametrize("name", list(MODELS), ids=["tiny-llama", "llama-3.1-8b"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_row_is_the_memory_table_of_its_plan(models, name, dtype):
    model, run = models[name], MODELS[name]
    for data in _plans():
        expected = {"as planned": _memory_table(data, model, dtype, run), **{
            label: _memory_table(flipped, model, dtype, run) for label, flipped in _flipped(data).items()}}
        resolved = rewrite.resolve(data, model)
        found, skipped = option_memory(resolved, model, dtype=dtype, **run)
        assert skipped == [] and [label for label, _ in found] == list(expected)
        for label, m in found:
            top, _ = expected[label]
            assert (m.rank, m.weights, m.activations) == (top["rank"], top["weights"], top["activations"]), label
        text = format_options(resolved, model, dtype=dtype, **run)
        rows = {r["plan"]: r for r in _cells(text, "plan")}
        assert list(rows) == list(expected)
        for label, (top, row) in expected.items():
            got = rows[label]
            assert (got["rank"], got["parameters"], got["activations"]) == (
                row["rank"], row["weights"], row["activations"]), label
    # The compute dtype reaches the rows: bfloat16 activations are fewer bytes than float32's.
    planned = {d: option_memory(rewrite.resolve(_plans()[0], model), model, dtype=d, **run)[0][0][1].activations
               for d in ("float32", "bfloat16")}
    assert planned["bfloat16"] < planned["float32"]


def test_show_passes_its_dtype_to_the_options_table():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", str(PLANS / "llama-tp2-pp2.yaml"), "--model", "tiny-llama", "--dtype", "bfloat16"]) == 0
    text = out.getvalue()
    memory = {r["rank"]: r for r in _cells(text, "rank")}
    planned = next(r for r in _cells(text, "plan") if r["plan"] == "as planned")
    assert "bfloat16" in text and (planned["parameters"], planned["activations"]) == (
        memory[planned["rank"]]["weights"], memory[planned["rank"]]["activations"])
    assert "total = weights + grads + AdamW + gathered + activations; gathered: autocast's copies" in text
