"""The `rewrite` command: through its entry point in this process (what the console script calls), and as
the installed console script in a process of its own."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

PLAN = "plans/llama-tp2-pp2.yaml"


def rewrite_cmd(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    """`rewrite ARGS` from the repository root: `rewrite.run.cli.main` in this process (a fresh interpreter
    would spend its seconds importing torch), or with `script` the installed console script, a process of its
    own, as `train` always is (it may start a process group and signal handlers). Its status, stdout and
    stderr either way."""
    if script or args[:1] == ("train",):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        exe = [str(Path(sys.executable).parent / "rewrite")] if script else [sys.executable, "-m", "rewrite"]
        return subprocess.run([*exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    from rewrite.run.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as exc:  # argparse's usage errors and --help
                status = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["rewrite", *args], status, out.getvalue(), err.getvalue())


def test_show_prints_the_three_tables():
    out = rewrite_cmd("show", PLAN, "--model", "tiny-llama")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "plans/llama-tp2-pp2.yaml on LlamaForCausalLM (tiny-llama)" in text
    assert "mesh: pp=2 x tp=2 = 4 ranks" in text
    # module path -> style -> whole and per-rank shapes, the 4 layers in one row (q_proj: 8 heads x 8 dims, split in 2)
    rows = [line.split() for line in text.splitlines()]
    assert ["model.layers.0-3.self_attn.q_proj", "column", "[64,", "64]", "->", "[32,", "64]", "model.layers.*.self_attn.q_proj"] in rows
    assert ["model.layers.0-3.mlp.down_proj", "row", "[64,", "128]", "->", "[64,", "64]", "model.layers.*.mlp.down_proj"] in rows
    # stages -> modules, with their global ranks
    assert "model.embed_tokens, model.rotary_emb, model.layers.0-1" in text
    assert "model.rotary_emb, model.layers.2-3, model.norm, lm_head" in text
    # parameters per rank: 4 rows, which add up to the whole model once tp halves are counted once
    ranks = [r for r in rows if len(r) >= 4 and r[0] in "0123" and r[1] in "01" and r[2] in "01"]
    assert [r[0] for r in ranks] == ["0", "1", "2", "3"], ranks
    assert "whole model: 180,800 parameters" in text


def test_show_data_parallel_in_the_plans_dtype():
    out = rewrite_cmd("show", "plans/llama-dp2-tp2-pp2.yaml", "--model", "tiny-llama", "--dtype", "bfloat16")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    flat = " ".join(text.split())  # prose wraps at 100 columns
    assert "mesh: dp=2 x pp=2 x tp=2 = 8 ranks" in text
    assert "ranks: rank = (dp_rank * pp + pp_rank) * tp + tp_rank" in text
    assert "(0: ranks 0-3, 1: ranks 4-7)" in text and "data parallel: sharding full" in text
    assert ("weights and grads in float32, activations and gathered or cast weights in bfloat16, AdamW's 2 moments "
            "in float32") in flat
    # Rank 0: stage 0's 53,504 tp-local parameters halved by dp; float32 master weights: 4 bytes each, AdamW 8.
    rows = [line.split() for line in text.splitlines()]
    assert ["0", "0", "0", "26,752", "104.5", "KiB", "104.5", "KiB", "209.0", "KiB"] == next(r for r in rows if len(r) == 16 and r[0] == "0")[:10]
    assert "ranks 4-7 (replica 1) hold the same as ranks 0-3, rank for rank" in text
    assert "the fullest rank under each sharding, params + grads + AdamW: full " in flat


def test_validate_names_the_data_parallel_mesh():
    plan = "plans/llama-dp2-tp2-pp2.yaml"
    words = "dp=2 x pp=2 x tp=2 = 8 ranks, 2 replicas with data_parallel.sharding full"
    ok = rewrite_cmd("validate", plan, "--model", "tiny-llama")
    assert ok.returncode == 0, ok.stderr
    assert f"OK for LlamaForCausalLM (tiny-llama): {words}, 28 sharded modules, 2 stages" in ok.stdout
    assert f"OK as a plan (mesh {words})" in rewrite_cmd("validate", plan).stdout
    for model in ([], ["--model", "tiny-llama"]):  # one message, with or without a model: the dp that fills 4
        out = rewrite_cmd("validate", plan, "--world-size", "4", *model)
        assert out.returncode == 1
        assert ("line 8: mesh: dp=2 x pp=2 x tp=2 = 8 ranks, but the world size is 4; launch 8 processes "
                "or set mesh.dp: 1 (pp x tp = 4 ranks per replica)") in out.stderr


def test_show_reads_a_config_json_and_a_model_directory(tmp_path):
    from rewrite.run.presets import build_config

    build_config("tiny-qwen3").save_pretrained(tmp_path)  # writes config.json only
    for model in (tmp_path / "config.json", tmp_path):
        out = rewrite_cmd("show", "plans/llama-tp2.yaml", "--model", str(model))
        assert out.returncode == 0, out.stderr
        assert "Qwen3ForCausalLM" in out.stdout
        assert "model.layers.0-3.self_attn.q_norm  grad_allreduce  [8]" in out.stdout and "  (implied)\n" in out.stdout


def test_validate_ok_and_every_problem_with_exit_1(tmp_path):
    ok = rewrite_cmd("validate", PLAN, "--model", "tiny-mistral")
    assert ok.returncode == 0, ok.stderr
    assert "OK for MistralForCausalLM" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "mesh: {pp: 2, tp: 2}\n"
        "tensor_parallel:\n"
        '  "model.layers.*.self_attn.q_projj": column\n'
        "pipeline:\n"
        '  cut_points: ["model.layers.7"]\n'
    )
    out = rewrite_cmd("validate", str(bad), "--model", "tiny-llama")
    assert out.returncode == 1
    assert out.stdout == ""
    assert f"{bad}: 2 problems" in out.stderr
    assert "did you mean 'model.layers.*.self_attn.q_proj'?" in out.stderr
    assert "pipeline.cut_points[0] 'model.layers.7' is not a layer" in out.stderr
    assert "Traceback" not in out.stderr


def test_validate_schema_problems_without_a_model(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh: {pp: 2, tpp: 2}\npipeline: {microbatches: 0}\n")
    out = rewrite_cmd("validate", str(bad))
    assert out.returncode == 1
    assert "2 problems" in out.stderr
    assert "unknown key 'tpp'; did you mean 'tp'?" in out.stderr
    assert "pipeline.microbatches" in out.stderr


def test_unknown_model_names_the_presets():
    out = rewrite_cmd("show", PLAN, "--model", "tiny-lama")
    assert out.returncode == 1
    assert "tiny-llama" in out.stderr and "config.json" in out.stderr
    assert "Traceback" not in out.stderr


def test_schema_is_the_shipped_file_byte_for_byte():
    out = rewrite_cmd("schema", script=True)  # also: the console script is installed
    assert out.returncode == 0, out.stderr
    assert out.stdout == (ROOT / "plans" / "plan.schema.json").read_text()
    assert json.loads(out.stdout)["title"] == "rewrite parallel plan"


@pytest.mark.parametrize("args", [[], ["show", PLAN]])
def test_usage_errors_exit_2(args):
    out = rewrite_cmd(*args)
    assert out.returncode == 2
    assert "usage: rewrite" in out.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_train_refuses_a_timeout_that_is_not_positive(value):
    out = rewrite_cmd("train", "plans/llama-tp2.yaml", "--timeout", value)
    assert out.returncode == 1, out.stderr
    assert f"--timeout is {float(value)!r}; use a positive number of seconds, e.g. --timeout 300" in out.stderr
    assert "Traceback" not in out.stderr


def test_train_timeout_reaches_init_process_group(monkeypatch):
    """`--timeout` becomes the timeout of the group `train` creates; stopped right there."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rewrite.run.cli import main
    from rewrite.run.train import TrainConfig
    from rewrite.run.train_entry import build_init_kwargs

    class Joined(Exception):
        pass

    calls = []

    def fake_init(*args, **kwargs):
        calls.append((args, kwargs))
        raise Joined

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "0" if name != "MASTER_ADDR" else "127.0.0.1")
    with pytest.raises(Joined):
        main(["train", "plans/llama-tp2.yaml", "--timeout", "42.5"])
    assert calls == [((), {"backend": "gloo", "timeout": timedelta(seconds=42.5)})]
    assert build_init_kwargs(TrainConfig("plans/llama-tp2.yaml"))["timeout"] == timedelta(minutes=5)


def test_every_train_config_field_has_one_flag_and_parses_to_its_default():
    """The parser and `_cmd_train` read one table: a TrainConfig field without a flag fails here."""
    import argparse
    from dataclasses import fields

    from rewrite.run.cli import build_parser
    from rewrite.run.train import TrainConfig
    from rewrite.run.train_flags import FLAGS, train_config

    dests: dict[str, set[str]] = {}
    for flag in FLAGS:
        dests.setdefault(flag.field, set()).add(flag.dest)
    assert sorted(dests) == sorted(f.name for f in fields(TrainConfig))
    assert all(len(d) == 1 for d in dests.values()), dests  # --parity and --no-parity: one dest
    assert len(set().union(*dests.values())) == len(dests), dests  # no two fields share a dest
    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    from rewrite.run.train_launch import LAUNCH_DESTS

    # no flag beside the tables (the launcher's own are taken out of what its workers run)
    assert {a.dest for a in train._actions} - {"help"} == {f.dest for f in FLAGS} | LAUNCH_DESTS
    assert train_config(parser.parse_args(["train", "plans/llama-tp2.yaml"])) == TrainConfig("plans/llama-tp2.yaml")
    args = parser.parse_args(["train", "p.yaml", "--out", "o", "--timeout", "7", "--dtype", "bfloat16", "--no-progress",
                              "--no-parity", "--resume", "--ckpt", "c", "--save-every", "2", "--batch-size", "3"])
    assert train_config(args) == TrainConfig("p.yaml", out_dir="o", timeout_s=7.0, dtype="bfloat16", progress=False,
                                             parity=False, resume=True, ckpt="c", save_every=2, batch_size=3)


def test_default_text_is_found_from_any_working_directory(tmp_path, monkeypatch):
    from rewrite.run.train import default_data_path

    monkeypatch.chdir(tmp_path)  # no data/ here: the copy beside the package is used
    assert default_data_path() == ROOT / "data" / "alice29.txt"


def test_show_schedule_prints_each_rank_and_the_bubble(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("mesh: {pp: 2}\npipeline: {schedule: 1f1b, microbatches: 3}\n")  # busy 9 of 12 units
    out = rewrite_cmd("show", str(plan), "--model", "tiny-llama", "--schedule")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Schedule 1f1b: 3 microbatches on 2 stages" in text
    rows = [line.split() for line in text.splitlines()]
    assert ["0", "F0", "F1", "B0", "F2", "B1", "B2", "2", "25%"] in rows, text
    assert ["1", "F0", "B0", "F1", "B1", "F2", "B2", "1", "25%"] in rows, text
    assert "predicted bubble: 25% of the step" in text
