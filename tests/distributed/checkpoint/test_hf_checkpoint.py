"""Checkpoints: save under one plan, load with transformers or under another plan, nothing lost."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

import rewrite
import rewrite.checkpoint.hf_save as checkpoint
from rewrite import ColumnParallelLinear, RowParallelLinear
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.multiproc import run
from tests.reference import assert_counted_once

TP2, PP2, TP4 = "plans/llama-tp2.yaml", "plans/llama-pp2.yaml", "plans/llama-tp4.yaml"
TP2PP2 = "plans/llama-tp2-pp2.yaml"


def _batch(config, seed: int, microbatches: int = 4, mb: int = 2, seq: int = 10):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, config.vocab_size, (mb, seq), generator=gen) for _ in range(microbatches)]
    return ids, [torch.randint(0, config.vocab_size, (mb, seq), generator=gen) for _ in ids]


def _train_step(stage, config, seed: int) -> float:
    ids, targets = _batch(config, seed)
    loss = rewrite.run_schedule(stage, ids, targets)
    torch.optim.SGD(stage.parameters(), lr=0.5).step()
    return loss.item()


def _local_slices(model) -> dict[str, tuple[torch.Tensor, int | None, int]]:
    """Every state-dict tensor this rank holds: (tensor, sharded dim or None, start of its slice)."""
    out = {}
    for name, tensor in model.state_dict().items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        dim, start = None, 0
        if isinstance(owner, ColumnParallelLinear):
            dim, start = 0, owner.tp_rank * owner.out_per_rank
        elif isinstance(owner, RowParallelLinear) and leaf == "weight":
            dim, start = 1, owner.tp_rank * owner.in_per_rank
        out[name] = (tensor.detach().clone(), dim, start)
    return out


def _assert_same_local(name: str, before: dict, after: dict) -> None:
    assert before.keys() == after.keys(), f"{name}: tensors differ: {sorted(before.keys() ^ after.keys())}"
    for key, (t, dim, start) in before.items():
        u, udim, ustart = after[key]
        assert (dim, start, t.dtype) == (udim, ustart, u.dtype) and torch.equal(t, u), f"{name}: {key} changed"


def _assemble(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Full tensors put together from every rank's slices; replicated copies must agree."""
    parts: dict[str, dict[int, tuple]] = {}
    for r, result in enumerate(results):
        for name, (tensor, dim, start) in result[key].items():
            seen = parts.setdefault(name, {})
            if start in seen:
                assert torch.equal(seen[start][1], tensor), f"{name}: rank {r}'s replicated copy differs"
            seen[start] = (dim, tensor)
    full = {}
    for name, by_start in parts.items():
        (dim, _), *_ = by_start.values()
        pieces = [t for _, (_, t) in sorted(by_start.items())]
        full[name] = pieces[0] if dim is None else torch.cat(pieces, dim=dim)
    return full


def _hf_load(directory: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers reported loading problems for {directory}: {problems}"
    return model


def _assert_equal_to_hf(full: dict[str, torch.Tensor], hf_model, what: str) -> None:
    hf = hf_model.state_dict()
    assert full.keys() == hf.keys(), f"{what}: {sorted(full.keys() ^ hf.keys())}"
    for name, tensor in full.items():
        assert tensor.dtype == hf[name].dtype, f"{what}: {name} is {hf[name].dtype}, trained as {tensor.dtype}"
        assert torch.equal(tensor, hf[name]), f"{what}: {name} differs after save + transformers load"


def _reference_loss(model, config, seed: int) -> torch.Tensor:
    ids, targets = _batch(config, seed)
    with torch.no_grad():
        return sum(rewrite.causal_lm_loss(model(input_ids=x).logits, y) for x, y in zip(ids, targets)) / len(ids)


def _stored_names(directory: Path) -> list[str]:
    names = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


def _param_bytes(stage) -> int:
    return sum(p.numel() * p.element_size() for p in stage.model.parameters())


def _tp2pp2_round_trip(rank: int, ws: int, directory: str) -> dict:
    config = build_config("tiny-llama")
    stage = rewrite.apply_plan(build_model(config, seed=3), TP2PP2)
    _train_step(stage, config, seed=5)
    trained = _local_slices(stage.model)
    rewrite.save_pretrained(stage, TP2PP2, directory)
    same = rewrite.from_pretrained(directory, TP2PP2)
    assert_counted_once(f"rank {rank} reloaded under {TP2PP2}", same, build_model(config, seed=3))
    _assert_same_local(f"rank {rank} reloaded under {TP2PP2}", trained, _local_slices(same.model))
    spec = same.resolved.stages[same.stage_ids[0]]  # one stage per rank
    loaded_bytes = _param_bytes(same)
    assert loaded_bytes == spec.param_bytes, (loaded_bytes, spec.param_bytes)
    # Another plan on the same ranks: one stage, four tensor-parallel ranks.
    other = rewrite.from_pretrained(directory, TP4)
    assert_counted_once(f"rank {rank} reloaded under {TP4}", other, build_model(config, seed=3))
    assert _param_bytes(other) == other.resolved.stages[0].param_bytes
    next_loss = _train_step(other, config, seed=6)
    return {"trained": trained, "next_loss": next_loss, "bytes": loaded_bytes,
            "total_bytes": same.resolved.total_bytes}


def test_tp2_pp2_train_save_load_with_transformers_and_another_plan(tmp_path):
    directory = tmp_path / "ckpt"
    results = run(_tp2pp2_round_trip, 4, str(directory), timeout_s=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "a temporary directory was left behind"
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    ]
    hf = _hf_load(directory)
    _assert_equal_to_hf(_assemble(results, "trained"), hf, "tp2 x pp2 after a training step")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(_stored_names(directory)) == sorted(hf.state_dict())
    # The next step under tp4 starts from exactly what was saved.
    reference = _reference_loss(hf, build_config("tiny-llama"), seed=6)
    for r, result in enumerate(results):
        assert_close(f"rank {r} next-step loss under {TP4}", torch.tensor(result["next_loss"]), reference)
    # Each rank holds about its share of the parameters, never the whole model.
    total = results[0]["total_bytes"]
    for r, result in enumerate(results):
        assert result["bytes"] <= 1.5 * total / 4, (r, result["bytes"], total)
    assert sum(r["bytes"] for r in results) < 1.5 * total


def _tied_bf16(rank: int, ws: int, tp_dir: str, pp_dir: str) -> dict:
    config = build_config("tiny-llama", tie_word_embeddings=True)
    stage = rewrite.apply_plan(build_model(config, seed=4, dtype=torch.bfloat16), TP2)
    _train_step(stage, config, seed=7)
    trained = _local_slices(stage.model)
    rewrite.save_pretrained(stage.model, TP2, tp_dir)  # a bare model works as well as a Stage
    reloaded = rewrite.from_pretrained(tp_dir, TP2)
    _assert_same_local(f"rank {rank} reloaded under {TP2}", trained, _local_slices(reloaded.model))
    piped = rewrite.from_pretrained(tp_dir, PP2)
    assert {p.dtype for p in piped.parameters()} == {torch.bfloat16}
    assert len(piped.tied) == 1, "the tied embedding must be shared between the first and last stage"
    tied = piped.tied[0].detach().clone()
    rewrite.save_pretrained(piped, PP2, pp_dir)
    next_loss = _train_step(piped, config, seed=8)
    return {"trained": trained, "next_loss": next_loss, "tied": tied}


def test_tied_bf16_tp2_then_pp2(tmp_path):
    tp_dir, pp_dir = tmp_path / "tp2", tmp_path / "pp2"
    results = run(_tied_bf16, 2, str(tp_dir), str(pp_dir), timeout_s=90)
    hf = _hf_load(tp_dir)
    assert hf.dtype == torch.bfloat16 and json.loads((tp_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert hf.lm_head.weight is hf.model.embed_tokens.weight, "transformers did not re-tie the embeddings"
    _assert_equal_to_hf(_assemble(results, "trained"), hf, "tp2, tied, bf16")
    # Tied embeddings are written once, under the name transformers expects.
    for directory in (tp_dir, pp_dir):
        stored = _stored_names(directory)
        assert "lm_head.weight" not in stored and stored.count("model.embed_tokens.weight") == 1, directory
    # Loaded under pp2 and saved again: the same checkpoint, split differently.
    hf_pp = _hf_load(pp_dir)
    assert hf_pp.dtype == torch.bfloat16
    _assert_equal_to_hf(dict(hf.state_dict()), hf_pp, "tp2 -> pp2 -> save")
    for r, result in enumerate(results):
        assert torch.equal(result["tied"], hf.model.embed_tokens.weight), f"rank {r}: tied copy differs"
    reference = _reference_loss(hf, build_config("tiny-llama", tie_word_embeddings=True), seed=8)
    for r, result in enumerate(results):
        loss = torch.tensor(result["next_loss"])
        assert_close(f"rank {r} next-step loss under {PP2} (bf16)", loss, reference, atol=1e-3, rtol=1e-3)


def _expect_error(fn, kind=ValueError) -> str:
    try:
        fn()
    except kind as exc:
        return str(exc)
    raise AssertionError(f"expected a {kind.__name__}")


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _errors(rank: int, ws: int, root: str) -> dict:
    root = Path(root)
    loads = {
        case: _expect_error(lambda: rewrite.from_pretrained(root / case, plan)) for case, (_, plan, _) in LOAD_CASES.items()
    }
    loads["world"] = _expect_error(lambda: rewrite.from_pretrained(root / "good", TP4))
    # A checkpoint written by transformers itself (4 shards) loads under pp2.
    stage = rewrite.from_pretrained(root / "good", PP2)
    loaded = _local_slices(stage.model)
    out = root / "out"
    rewrite.save_pretrained(stage, PP2, out)
    before = _digest(out)
    saves = [_expect_error(lambda: rewrite.save_pretrained(stage, TP2, out)),
             _expect_error(lambda: rewrite.save_pretrained(stage.model, TP2, out))]
    save_file = checkpoint.save_file
    if rank == 1:  # a write that fails on one rank only, after the others wrote theirs

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        checkpoint.save_file = full_disk
    saves.append(_expect_error(lambda: rewrite.save_pretrained(stage, PP2, out), RuntimeError))
    intact = before == _digest(out)
    dist.barrier()  # every rank has looked before rank 0 changes the directory
    if rank == 0:  # a tokenizer is kept, a stale weight file (an earlier pp1 save) removed
        (out / "tokenizer.json").write_text("{}")
        shutil.copy(root / "heads" / "model.safetensors", out / "model.safetensors")
    dist.barrier()  # also shows that nobody was left inside a collective
    checkpoint.save_file = save_file
    rewrite.save_pretrained(stage, PP2, out)
    return {"loads": loads, "saves": saves, "intact": intact, "loaded": loaded, "resaved": sorted(_digest(out))}


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


LOAD_CASES = {
    # case: (how the good checkpoint is broken, the plan, what every rank's error must say)
    "missing-shard": (lambda d: (d / "model-00004-of-00004.safetensors").unlink(), PP2,
                      "rank 1: {d}/model-00004-of-00004.safetensors: shard file missing"),
    "truncated": (lambda d: (d / "model-00002-of-00004.safetensors").write_bytes(
                      (d / "model-00002-of-00004.safetensors").read_bytes()[:-100]), PP2,
                  "{d}/model-00002-of-00004.safetensors: unreadable"),
    "missing-tensor": (lambda d: _edit_json(d / "model.safetensors.index.json",
                                            lambda j: j["weight_map"].pop("model.layers.3.mlp.up_proj.weight")), PP2,
                       "rank 1: {d}: tensor 'model.layers.3.mlp.up_proj.weight' is not in the checkpoint"),
    "wrong-shape": (lambda d: _edit_json(d / "config.json", lambda j: j.update(intermediate_size=96)), PP2,
                    "tensor 'model.layers.0.mlp.up_proj.weight' has shape [128, 64], but config.json implies [96, 64]"),
    # 9 heads, 3 kv heads: tp 2 divides neither, nor is a multiple of the kv heads (tp 1, 3 or 9 would do).
    "heads": (None, TP2, "{d}/config.json (LlamaForCausalLM: num_hidden_layers=4, hidden_size=72, "
              "num_attention_heads=9, num_key_value_heads=3) does not fit the plan"),
    "no-config": (lambda d: (d / "config.json").unlink(), TP2, "{d}/config.json: no such file"),
}


def test_bad_checkpoints_and_failed_saves_change_nothing(tmp_path):
    model = build_model("tiny-llama", seed=2)
    model.save_pretrained(tmp_path / "good", max_shard_size="200KB")  # ~720 KB: 4 shards
    for case, (breaks, _, _) in LOAD_CASES.items():
        if breaks is None:
            build_model(build_config("tiny-llama", hidden_size=72, num_attention_heads=9,
                                     num_key_value_heads=3)).save_pretrained(tmp_path / case)
        else:
            shutil.copytree(tmp_path / "good", tmp_path / case)
            breaks(tmp_path / case)
    results = run(_errors, 2, str(tmp_path), timeout_s=90)
    for r, result in enumerate(results):
        for case, (_, _, expected) in LOAD_CASES.items():
            expected = expected.format(d=tmp_path / case)
            assert expected in result["loads"][case], f"rank {r}, {case}: {result['loads'][case]}"
        assert "needs pp=1 x tp=4 = 4 ranks, but the world size is 2" in result["loads"]["world"]
        assert "mesh.tp=2 does not divide num_attention_heads=9 nor num_key_value_heads=3" in result["loads"]["heads"]
        assert "kv heads (tp 1 or 3) or be a multiple of them" in result["loads"]["heads"]
        assert "the stage was built with mesh pp=2 x tp=1, the plan says pp=1 x tp=2" in result["saves"][0]
        assert "rank 0: pp_rank 0, tp_rank 0: 14 tensors have other shapes than the plan gives this rank, e.g. " \
            "model.layers.0.self_attn.q_proj.weight: [64, 64] here, [32, 64] in the plan" in result["saves"][1]
        disk_full = "rank 1: writing stage 1: OSError: [Errno 28] No space left on device\n  nothing in "
        assert disk_full in result["saves"][2]
        assert result["intact"], f"rank {r}: a failed save changed the existing checkpoint"
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name], "a temporary directory was left behind"
    assert results[0]["resaved"] == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
    ]
    _assert_equal_to_hf(_assemble(results, "loaded"), model, "transformers checkpoint loaded under pp2")
    _assert_equal_to_hf(_assemble(results, "loaded"), _hf_load(tmp_path / "out"), "pp2 save of it")

