"""The plan search (`rewrite.suggest_plans`, `rewrite plan`) on real configs and a tiny model."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import yaml

import rewrite
from rewrite.estimate.hardware import load_hardware
from rewrite.estimate.memory import GIB, rank_memory
from rewrite.estimate.search import NoPlanFits
from rewrite.estimate.search_space import microbatch_counts
from rewrite.run.presets import build_model, load_config
from tests.paths import ROOT
from tests.unit.run.test_cli import rewrite_cmd

CONFIGS = ROOT / "tests" / "configs"


def _meshes(found):
    return {(c.plan.mesh.dp, c.plan.mesh.pp, c.plan.mesh.tp) for c in found}


def test_the_planner_reduces_per_microbatch_where_a_steps_whole_gradients_do_not_fit():
    config = load_config(CONFIGS / "llama-3.1-8b.json")
    (best,) = [c for c in rewrite.suggest_plans(config, world=8, device_memory=80, seq_len=4096, global_batch=32)
               if c.plan.mesh.dp == 8]
    assert best.plan.data_parallel.reduce == "microbatch" and best.plan.data_parallel.sharding != "replicate"
    # The recipe `rewrite train` runs on a GPU: float32 master weights, bfloat16 compute (h100-sxm's default).
    assert best.dtype == "bfloat16"
    model = build_model(config, device="meta", dtype=torch.float32)
    peaks = {}
    for reduce in ("step", "microbatch"):
        plan = best.plan.model_copy(update={"data_parallel": best.plan.data_parallel.model_copy(update={"reduce": reduce})})
        resolved = rewrite.resolve(rewrite.load_plan(plan.model_dump(mode="json")), model)
        peaks[reduce] = max(m.total for m in rank_memory(resolved, model, batch_size=best.batch_size, dtype="bfloat16"))
    # The whole model's float32 gradients (32 GB) held to the step's end would not fit in what 80 GiB leave to
    # tensors (less h100-sxm's reserve); one layer's at a time does.
    usable = load_hardware("h100-sxm").usable_gib(80) * GIB
    assert peaks["microbatch"] == best.peak_bytes <= usable < peaks["step"]


def test_llama_8b_over_8_devices_of_80_gib():
    found = rewrite.suggest_plans(load_config(CONFIGS / "llama-3.1-8b.json"), world=8, device_memory=80)
    assert [c.step_s for c in found] == sorted(c.step_s for c in found)
    usable = load_hardware("h100-sxm").usable_gib(80) * GIB  # 80 GiB less the profile's reserve
    assert all(c.fits and c.peak_bytes <= usable and c.plan.mesh.world_size == 8 for c in found)
    assert len(_meshes(found)) == len(found) >= 6  # the best of every mesh that fits
    assert {tp for _, _, tp in _meshes(found)} == {1, 2, 4, 8}
    assert all(0 < c.mfu < 1 and c.tokens_per_s > 0 for c in found)
    best = found[0]
    model = build_model(load_config(CONFIGS / "llama-3.1-8b.json"), device="meta", dtype=torch.float32)
    resolved = rewrite.resolve(rewrite.load_plan(best.plan.model_dump(mode="json")), model)
    assert max(m.total for m in rank_memory(resolved, model, batch_size=best.batch_size, dtype=best.dtype)) == best.peak_bytes
    assert best.plan.mesh.dp * best.plan.pipeline.microbatches * best.batch_size == 32  # 4 sequences a device


def test_plans_fit_in_what_a_device_leaves_to_tensors(tmp_path):
    # Llama-3.1-8B at 8,192 tokens on 8 x 80 GiB: the plans that would fill the card to 77 GiB are refused, the
    # profile's reserve (the CUDA context, NCCL's buffers) and fragmentation kept free; `show` marks the ranks
    # against the same figure, and a device memory within the reserve is refused.
    config = load_config(CONFIGS / "llama-3.1-8b.json")
    h100 = load_hardware("h100-sxm")
    usable = h100.usable_gib(80) * GIB
    assert usable == pytest.approx((80 - h100.memory_reserve_gib) * (1 - h100.fragmentation) * GIB)
    run = dict(world=8, device_memory=80, seq_len=8192, global_batch=16)
    found = rewrite.suggest_plans(config, **run)
    assert all(c.peak_bytes <= usable for c in found)
    bare = h100.model_copy(update={"memory_reserve_gib": 0.0, "fragmentation": 0.0})  # the whole card
    crowded = [c for c in rewrite.suggest_plans(config, hardware=bare, **run) if c.peak_bytes > usable]
    assert crowded and all(c.peak_bytes <= 80 * GIB for c in crowded)  # what the reserve keeps out
    plan = tmp_path / "best.yaml"
    assert rewrite_cmd("plan", "--model", str(CONFIGS / "llama-3.1-8b.json"), "--world", "8", "--device-memory", "80",
                       "--seq-len", "8192", "--global-batch", "16", "--out", str(plan)).returncode == 0
    assert "within 73.1 GiB usable on h100-sxm (80 GiB less 3 GiB reserved and 5% for the allocator)" in plan.read_text()
    shown = rewrite_cmd("show", str(plan), "--model", str(CONFIGS / "llama-3.1-8b.json"), "--hardware", "h100-sxm",
                        "--batch-size", str(found[0].batch_size), "--dtype", "bfloat16").stdout
    assert "fits" in shown and "fit in 72.8 GiB usable on h100-sxm (79.6 GiB less 3 GiB reserved" in shown, shown
    bad = rewrite_cmd("plan", "--model", "tiny-llama", "--world", "2", "--device-memory", "2")
    assert bad.returncode == 2 and "within the 3 GiB that h100-sxm's profile reserves" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_llama_70b_fits_on_64_devices_with_tp_within_a_node_and_not_on_8():
    config = load_config(CONFIGS / "llama-3.1-70b.json")
    with pytest.raises(NoPlanFits, match=r"no plan fits.*the smallest world that fits at this memory is 16 devices"):
        rewrite.suggest_plans(config, world=8, device_memory=80)
    found = rewrite.suggest_plans(config, world=64, device_memory=80, gpus_per_node=8)
    usable = load_hardware("h100-sxm").usable_gib(80) * GIB
    assert found and all(c.plan.mesh.tp <= 8 and c.peak_bytes <= usable for c in found)
    assert found[0].plan.mesh.tp > 1 and found[0].plan.mesh.pp > 1


def test_smollm2_is_never_split_2_or_4_ways():
    found = rewrite.suggest_plans(load_config(CONFIGS / "smollm2-135m.json"), world=8, device_memory=80)
    assert found and {c.plan.mesh.tp for c in found} == {1}  # 9 heads, 3 kv heads: tp 3 or 9, neither divides 8
    found = rewrite.suggest_plans(load_config(CONFIGS / "smollm2-135m.json"), world=6, device_memory=80, gpus_per_node=6)
    assert {c.plan.mesh.tp for c in found} == {1, 3}


def test_a_tiny_model_on_the_cpu_profile_gets_dp_pp_and_tp_candidates():
    found = rewrite.suggest_plans(build_model("tiny-llama", device="meta"), world=4, device_memory=1,
                                  hardware="cpu", seq_len=128)
    meshes = _meshes(found)
    assert any(dp > 1 for dp, _, _ in meshes) and any(pp > 1 for _, pp, _ in meshes)
    assert any(tp > 1 for _, _, tp in meshes)
    schedules = {c.plan.pipeline.schedule for c in found if c.plan.mesh.pp > 1}
    assert schedules <= {"afab", "1f1b", "zero-bubble", "interleaved-1f1b", "zbv"}
    tight = rewrite.suggest_plans(build_model("tiny-llama", device="meta"), world=2, device_memory=0.004,
                                  hardware="cpu", seq_len=256)
    assert all(c.peak_bytes <= 0.004 * GIB for c in tight)
    assert any(c.checkpointing != "off" or c.plan.mesh.dp == 1 for c in tight)


def test_microbatch_counts_divide_the_replicas_share():
    assert microbatch_counts(64, 4) == [4, 8, 16]
    assert microbatch_counts(6, 4) == [6]
    assert microbatch_counts(8, 1) == [1, 2, 4, 8]


def test_bad_arguments_are_refused():
    config = load_config(CONFIGS / "llama-3.1-8b.json")
    for kwargs, match in (({"world": 0}, "`world` is 0"), ({"world": 8, "device_memory": -1}, "`device_memory` is -1"),
                          ({"world": 8, "seq_len": 0}, "`seq_len` is 0")):
        with pytest.raises(ValueError, match=match):
            rewrite.suggest_plans(config, **kwargs)
    with pytest.raises(ValueError, match="unknown hardware"):
        rewrite.suggest_plans(config, world=8, hardware="tpu")


def test_rewrite_plan_writes_a_plan_that_validates_and_shows_the_memory_it_predicted(tmp_path):
    out = tmp_path / "best.yaml"
    run = rewrite_cmd("plan", "--model", "tiny-llama", "--world", "4", "--device-memory", "1", "--hardware", "cpu",
                      "--seq-len", "128", "--out", str(out), "--json")
    assert run.returncode == 0, run.stderr
    candidates = json.loads(run.stdout)["candidates"]
    best = candidates[0]
    assert {"plan", "step_s", "tokens_per_s", "mfu", "peak_bytes", "fits"} <= set(best)
    assert [c["step_s"] for c in candidates] == sorted(c["step_s"] for c in candidates)
    text = out.read_text()
    assert text.startswith("# Planned by `rewrite plan --model tiny-llama --world 4") and "# Predicted on cpu" in text
    assert rewrite.load_plan(out).model_dump(mode="json")["mesh"] == best["plan"]["mesh"]
    valid = rewrite_cmd("validate", str(out), "--model", "tiny-llama", "--world-size", "4")
    assert valid.returncode == 0, valid.stderr
    shown = rewrite_cmd("show", str(out), "--model", "tiny-llama", "--batch-size", str(best["batch_size"]), "--json")
    assert shown.returncode == 0, shown.stderr
    assert max(r["total"] for r in json.loads(shown.stdout)["memory"]["ranks"]) == best["peak_bytes"]
    assert best["dtype"] == "float32" and "--dtype float32" in text  # the cpu profile has no bfloat16 peak
    # On a GPU profile (h100-sxm, plan's default) the recipe computes in bfloat16 over float32 weights: the
    # plan's show and train lines name it, and show prints the memory planned, with --dtype or by its default.
    big = tmp_path / "8b.yaml"
    config = str(CONFIGS / "llama-3.1-8b.json")
    run = rewrite_cmd("plan", "--model", config, "--world", "8", "--device-memory", "80", "--out", str(big), "--json")
    assert run.returncode == 0, run.stderr
    best = json.loads(run.stdout)["candidates"][0]
    assert best["dtype"] == "bfloat16"
    lines = big.read_text().splitlines()
    show_line = next(line for line in lines if line.startswith("#   rewrite show"))
    train_line = next(line for line in lines if line.startswith("#   torchrun"))
    assert f"--batch-size {best['batch_size']} --dtype bfloat16 --hardware h100-sxm" in show_line
    assert train_line.endswith(f"--batch-size {best['batch_size']} --seq-len 2048 --dtype bfloat16"), train_line
    for line in (show_line, show_line.replace(" --dtype bfloat16", "")):
        shown = rewrite_cmd(*line.removeprefix("#   rewrite ").split(), "--json")
        data = json.loads(shown.stdout)
        assert max(r["total"] for r in data["memory"]["ranks"]) == best["peak_bytes"]
        assert data["memory"]["dtype"] == "float32" and data["memory"]["compute_dtype"] == "bfloat16"
        assert data["predicted"]["step_s"] == pytest.approx(best["step_s"])
    piped = rewrite_cmd("plan", "--model", "tiny-llama", "--world", "2", "--hardware", "cpu", "--seq-len", "64",
                        "--top", "2")  # stdout not a terminal, no --out: the plan alone there, the table on stderr
    assert piped.returncode == 0 and "Plans for tiny-llama on 2 x cpu" in piped.stderr, piped.stderr
    assert piped.stdout.startswith("# Planned by") and "Plans for" not in piped.stdout
    assert "rewrite show PLAN.yaml" in piped.stdout  # a pipe: no file to name
    assert rewrite.load_plan(yaml.safe_load(piped.stdout)).mesh.world_size == 2


def test_rewrite_plan_at_a_terminal_writes_plan_yaml_and_never_over_a_file(tmp_path, monkeypatch, capsys):
    from rewrite.run.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    (tmp_path / "plan.yaml").write_text("mine\n")
    args = ["plan", "--model", "tiny-llama", "--world", "2", "--hardware", "cpu", "--seq-len", "64", "--top", "1"]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "Plans for tiny-llama" in said and "wrote plan-2.yaml (--out FILE names another)" in said, said
    assert (tmp_path / "plan.yaml").read_text() == "mine\n"  # untouched
    written = (tmp_path / "plan-2.yaml").read_text()
    assert "#   rewrite show plan-2.yaml --model tiny-llama" in written and "mesh:" not in said


def test_rewrite_plan_nothing_fits_and_bad_arguments(tmp_path):
    out = tmp_path / "never.yaml"
    none = rewrite_cmd("plan", "--model", "tests/configs/llama-3.1-70b.json", "--world", "8", "--device-memory", "80",
                       "--out", str(out))
    assert none.returncode == 1 and "no plan fits" in none.stderr and "16 devices (--world 16, --global-batch" in none.stderr
    assert not out.exists() and "Traceback" not in none.stderr
    for args, words in ((["--world", "0"], "--world is 0"), (["--world", "2", "--device-memory", "0"], "--device-memory is 0"),
                        (["--world", "2", "--hardware", "tpu9"], "unknown hardware 'tpu9'"),
                        (["--world", "2", "--model", "tiny-lama"], "tiny-lama")):
        model = [] if "--model" in args else ["--model", "tiny-llama"]
        bad = rewrite_cmd("plan", *model, *args)
        assert bad.returncode == 2, (args, bad.stderr)
        assert words in bad.stderr and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr


def test_the_planner_splits_a_mixture_of_experts_by_expert_where_that_is_fastest():
    config = load_config(CONFIGS / "moe" / "qwen3-30b-a3b.json")
    found = rewrite.suggest_plans(config, world=8, device_memory=96, seq_len=2048, dtype="float32")
    # Qwen3-30B-A3B in float32 on 8 x 96 GiB: each rank holding 16 of a layer's 128 experts whole beats
    # gathering every layer's experts over dp (the exchanges of routed rows counted in its step); at tp 2
    # with ep 8 borrowing the tp ranks (each tp rank's half of the tokens to their experts: the MLP's compute
    # halved, one all-gather a layer each way) beats both.
    first = found[0].plan
    assert (first.mesh.dp, first.mesh.tp, first.mesh.ep) == (4, 2, 8)
    assert first.tensor_parallel["model.layers.*.mlp.experts"] == "expert_parallel"
    best = next(c for c in found if c.plan.mesh.ep > 1 and c.plan.mesh.tp == 1)
    assert (best.plan.mesh.dp, best.plan.mesh.ep) == (8, 8) and best.step_s > found[0].step_s
    assert best.plan.tensor_parallel == {"model.layers.*.mlp.experts": "expert_parallel"}
    assert not any(c.plan.mesh.ep == 1 and c.plan.mesh.tp == 1 and c.step_s < best.step_s for c in found)
    model = build_model(config, device="meta", dtype=torch.float32)
    resolved = rewrite.resolve(rewrite.load_plan(best.plan.model_dump(mode="json")), model)
    assert max(m.total for m in rank_memory(resolved, model, batch_size=best.batch_size)) == best.peak_bytes
    assert len({c.plan.mesh.ep for c in found}) > 1  # meshes without ep are ranked beside it
    # In bfloat16 over float32 weights (each rank's experts cast as they compute) too.
    narrow = rewrite.suggest_plans(config, world=8, device_memory=96, seq_len=2048, dtype="bfloat16")
    assert narrow[0].plan.mesh.ep == 8 and narrow[0].step_s < best.step_s
