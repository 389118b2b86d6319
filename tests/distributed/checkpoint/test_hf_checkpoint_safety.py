"""Checkpoints fail together and are never silently wrong: a killed save leaves the old or
the new checkpoint, shards of different saves are refused, mixed dtypes load as one."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import rewrite
from rewrite.checkpoint import swap
from rewrite.checkpoint.headers import load_dtype
from rewrite.run.presets import build_config, build_model
from tests.multiproc import run

ONE, PP2 = {}, "plans/llama-pp2.yaml"  # {}: the default plan, one rank
INDEX = "model.safetensors.index.json"


class _Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so no `except Exception` of the save runs,
    and the save's own clean-up after the failing step is skipped as a kill would."""


@contextlib.contextmanager
def _kill_before(step: int | None, *, exchange: bool):
    """Count every file-system change (os.mkdir/rename/replace/link/symlink/unlink/rmdir and
    the directory exchange) and raise _Killed instead of the change numbered `step`."""
    calls: list[str] = []
    saved = []

    def wrap(owner, name, fn):
        def killer(*args, **kwargs):
            if len(calls) == step:
                raise _Killed(f"killed before {name}{args}")
            calls.append(name)
            return fn(*args, **kwargs)

        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, killer)

    for name in ("mkdir", "rename", "replace", "link", "symlink", "unlink", "rmdir"):
        wrap(os, name, getattr(os, name))
    wrap(swap, "_exchange", swap._exchange if exchange else (lambda a, b: False))
    try:
        yield calls
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def _which(state: dict[str, torch.Tensor], expected: dict[str, dict]) -> str:
    """'old' or 'new' when `state` is exactly that checkpoint (names, dtypes, values), else 'mixed'."""
    for label, ref in expected.items():
        if state.keys() == ref.keys() and all(state[k].dtype == t.dtype and torch.equal(state[k], t)
                                              for k, t in ref.items()):
            return label
    return "mixed"


def _by_rewrite(directory: Path, expected) -> str:
    try:
        stage = rewrite.from_pretrained(directory, ONE)
    except ValueError:
        return "none"
    return _which(stage.model.state_dict(), expected)


def _by_transformers(directory: Path, expected) -> str:
    from transformers import AutoModelForCausalLM

    if not directory.is_dir():
        return "none"
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    return _which(model.state_dict(), expected)


def _ours(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((".ckpt.tmp-", ".ckpt.old-")))


def _kill_every_step(rank: int, ws: int, root: str) -> list[dict]:
    root = Path(root)
    expected = {"old": build_model("tiny-llama", seed=1, dtype=torch.bfloat16).state_dict(),
                "new": build_model("tiny-llama", seed=2).state_dict()}
    new = rewrite.apply_plan(build_model("tiny-llama", seed=2), ONE)
    records = []
    for mode in ("exchange", "fallback", "first"):  # first: no checkpoint there yet
        for step in range(100):
            directory = root / f"{mode}-{step}" / "ckpt"
            directory.parent.mkdir()
            if mode != "first":
                shutil.copytree(root / "old", directory)
            with _kill_before(step, exchange=mode == "exchange") as calls:
                try:
                    rewrite.save_pretrained(new, ONE, directory)
                    killed = False
                except _Killed:
                    killed = True
            record = {"mode": mode, "step": step, "killed": killed, "calls": list(calls),
                      "exists": directory.is_dir(), "stale": _ours(directory.parent),
                      "rewrite": _by_rewrite(directory, expected),
                      "transformers": _by_transformers(directory, expected),
                      "tokenizer": [(p / "tokenizer.json").read_text() for p in [swap.current(directory)]
                                    if (p / "tokenizer.json").is_file()]}
            rewrite.save_pretrained(new, ONE, directory)  # the next save recovers from any of these
            record["next"] = (_by_rewrite(directory, expected), _ours(directory.parent),
                              (directory / "tokenizer.json").is_file())
            records.append(record)
            if not killed:
                break
    return records


def test_killed_save_leaves_the_old_or_the_new_checkpoint(tmp_path):
    old = build_model("tiny-llama", seed=1, dtype=torch.bfloat16)
    old.save_pretrained(tmp_path / "old", max_shard_size="100KB")  # several shards + an index
    (tmp_path / "old" / "tokenizer.json").write_text('{"old": true}')
    records = run(_kill_every_step, 1, str(tmp_path), timeout_s=120)[0]
    wrong = []
    for r in records:
        where = f"{r['mode']}, killed before change {r['step']} ({r['calls'][-1:] or 'none yet'})"
        allowed = {"none", "new"} if r["mode"] == "first" else {"old", "new"}
        if r["rewrite"] not in allowed:
            wrong.append(f"{where}: rewrite.from_pretrained read {r['rewrite']}")
        if r["exists"] and r["transformers"] != r["rewrite"]:
            wrong.append(f"{where}: transformers read {r['transformers']}, rewrite {r['rewrite']}")
        if not r["exists"] and r["mode"] != "first" and not (r["mode"] == "fallback" and r["rewrite"] == "old"):
            wrong.append(f"{where}: the directory is missing and {r['stale']} did not stand in for it")
        if r["mode"] != "first" and r["tokenizer"] != ['{"old": true}']:
            wrong.append(f"{where}: tokenizer.json lost: {r['tokenizer']}")
        if r["next"] != ("new", [], r["mode"] != "first"):
            wrong.append(f"{where}: the next save gave {r['next']} (weights, temporaries left, tokenizer kept)")
        if not r["killed"] and (r["rewrite"], r["stale"]) != ("new", []):
            wrong.append(f"{where}: a complete save gave {r['rewrite']}, left {r['stale']}")
    assert not wrong, "\n".join(wrong)
    by_mode = {m: [r for r in records if r["mode"] == m] for m in ("exchange", "fallback", "first")}
    for mode, rs in by_mode.items():
        assert len(rs) >= 3 and not rs[-1]["killed"], (mode, len(rs))
        assert {r["rewrite"] for r in rs} == ({"none", "new"} if mode == "first" else {"old", "new"}), mode
    if sys.platform == "linux":
        assert "_exchange" in by_mode["exchange"][-1]["calls"] and "rename" not in by_mode["exchange"][-1]["calls"]
    assert any(not r["exists"] for r in by_mode["fallback"]), "the fallback never ran its two renames"


def _mixed(rank: int, ws: int, root: str) -> dict:
    root, config = Path(root), build_config("tiny-llama")
    for name, seed in (("a", 1), ("b", 2)):
        rewrite.save_pretrained(rewrite.apply_plan(build_model(config, seed=seed), PP2), PP2, root / name)
    if rank == 0:  # one shard from another save, as a hand-made copy would do
        shutil.copytree(root / "a", root / "mixed")
        shutil.copy(root / "b" / "model-00002-of-00002.safetensors", root / "mixed")
    dist.barrier()
    errors = []
    for plan in (PP2, "plans/llama-tp2.yaml"):
        try:
            rewrite.from_pretrained(root / "mixed", plan)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    ids = {}
    for name in ("a", "b"):
        for path in sorted((root / name).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                ids[f"{name}/{path.name}"] = f.metadata().get("rewrite_save_id")
        ids[f"{name}/{INDEX}"] = json.loads((root / name / INDEX).read_text())["metadata"].get("rewrite_save_id")
    stage = rewrite.from_pretrained(root / "hf", PP2)  # transformers-written: no save ids
    return {"errors": errors, "ids": ids, "hf": {k: v.clone() for k, v in stage.model.state_dict().items()}}


def test_shards_of_different_saves_are_refused_transformers_checkpoints_load(tmp_path):
    hf_model = build_model("tiny-llama", seed=3)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    results = run(_mixed, 2, str(tmp_path), timeout_s=90)
    ids = results[0]["ids"]
    a, b = ids["a/model-00001-of-00002.safetensors"], ids["b/model-00001-of-00002.safetensors"]
    assert len(a) == 32 and len(b) == 32 and a != b, ids
    assert {v for k, v in ids.items() if k.startswith("a/")} == {a} and {v for k, v in ids.items() if k.startswith("b/")} == {b}
    mixed = tmp_path / "mixed"
    expected = (f"ranks 0, 1: {mixed}: files from different saves: model-00002-of-00002.safetensors "
                f"(save id {b}), but model-00001-of-00002.safetensors, {INDEX} have save id {a}")
    for r, result in enumerate(results):
        for error in result["errors"]:
            assert error is not None and expected in error, f"rank {r}: {error}"
        assert result["errors"] == results[0]["errors"], f"rank {r} failed otherwise than rank 0"
    hf = hf_model.state_dict()
    for r, result in enumerate(results):
        assert result["hf"] and all(torch.equal(t, hf[k]) for k, t in result["hf"].items()), f"rank {r}"


def _stale(rank: int, ws: int, root: str) -> dict:
    root = Path(root)
    model = rewrite.apply_plan(build_model("tiny-llama", seed=4), ONE)
    rewrite.save_pretrained(model, ONE, root / "real")
    (root / "ckpt").symlink_to(root / "real")  # a symlinked checkpoint is swapped behind its link
    ours = [f".real.tmp-{uuid.uuid4().hex}", f".real.tmp-{uuid.uuid4().hex}", f".real.old-{uuid.uuid4().hex}"]
    others = [".real.tmp-notasaveid", f".real.tmp-{uuid.uuid4().hex.upper()}", f".realx.tmp-{uuid.uuid4().hex}",
              f".other.old-{uuid.uuid4().hex}", ".real.backup", f"real.tmp-{uuid.uuid4().hex}"]
    for name in ours + others:
        (root / name).mkdir()
        (root / name / "model.safetensors").write_text("stale")
    rewrite.save_pretrained(model, ONE, root / "ckpt")
    return {"listing": sorted(p.name for p in root.iterdir()), "ours": ours, "others": others,
            "link": (root / "ckpt").is_symlink(), "loads": bool(rewrite.from_pretrained(root / "ckpt", ONE))}


def test_next_save_removes_stale_temporaries_and_keeps_other_dot_dirs(tmp_path):
    result = run(_stale, 1, str(tmp_path), timeout_s=60)[0]
    assert result["listing"] == sorted(["ckpt", "real", *result["others"]]), result["listing"]
    assert result["link"] and result["loads"]
    assert (tmp_path / "real" / "model.safetensors").is_file() and os.readlink(tmp_path / "ckpt") == str(tmp_path / "real")


TENSOR = "model.layers.3.mlp.down_proj.weight"  # on stage 1 of pp2 only


def _fp16_inside(rank: int, ws: int, directory: str) -> dict:
    config = build_config("tiny-llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stage = rewrite.from_pretrained(directory, PP2)
    dtypes = sorted({str(p.dtype) for p in stage.parameters()})
    gen = torch.Generator().manual_seed(9)
    ids = [torch.randint(0, config.vocab_size, (2, 10), generator=gen) for _ in range(4)]
    targets = [torch.randint(0, config.vocab_size, (2, 10), generator=gen) for _ in ids]
    state = {k: t.clone() for k, t in stage.model.state_dict().items()}
    loss = rewrite.run_schedule(stage, ids, targets)
    torch.optim.SGD(stage.parameters(), lr=0.5).step()
    with warnings.catch_warnings(record=True) as asked:
        warnings.simplefilter("always")
        cast = rewrite.from_pretrained(directory, PP2, dtype=torch.bfloat16)
    return {"dtypes": dtypes, "loss": loss.item(), "warnings": [str(w.message) for w in caught],
            "asked": [str(w.message) for w in asked if "are cast to" in str(w.message)],
            "bf16": sorted({str(p.dtype) for p in cast.parameters()}),
            "tensor": state[TENSOR].clone() if TENSOR in state else None}


def test_fp16_tensor_in_fp32_checkpoint_is_cast_alike_on_every_rank(tmp_path):
    model = build_model("tiny-llama", seed=5)
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(str(path))
    tensors[TENSOR] = tensors[TENSOR].half()
    save_file(tensors, str(path), metadata={"format": "pt"})
    results = run(_fp16_inside, 2, str(tmp_path / "ckpt"), timeout_s=90)
    for r, result in enumerate(results):
        assert result["dtypes"] == ["torch.float32"] and result["bf16"] == ["torch.bfloat16"], (r, result)
        assert math.isfinite(result["loss"]) and result["loss"] == results[0]["loss"], (r, result["loss"])
    assert [w for w in results[0]["warnings"] if f"all are cast to torch.float32, e.g. {TENSOR}" in w]
    assert not [w for w in results[1]["warnings"] if "are cast to" in w], "only rank 0 warns"
    assert results[0]["asked"] == [], "an explicit dtype casts without a warning"
    assert torch.equal(results[1]["tensor"], tensors[TENSOR].float())
    # transformers loads the same checkpoint in the same dtype (its config's).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    assert hf.dtype == torch.float32 and torch.equal(hf.state_dict()[TENSOR], tensors[TENSOR].float())


def test_load_dtype_rule():
    def header(**dtypes):
        return {k: {"dtype": d, "shape": [n]} for k, (d, n) in dtypes.items()}

    keys = dict.fromkeys(["a", "b", "c"], "f")
    one = {"f": header(a=("F32", 10), b=("F32", 1), c=("I64", 1))}
    mixed = {"f": header(a=("F32", 10), b=("F16", 100), c=("I64", 1))}
    fp32 = build_config("tiny-llama", dtype="float32")
    assert load_dtype(one, keys, fp32, None) == (None, None)  # one stored dtype: kept
    assert load_dtype(one, keys, fp32, torch.bfloat16) == (torch.bfloat16, None)
    assert load_dtype(mixed, keys, fp32, torch.bfloat16) == (torch.bfloat16, None)  # the one asked for
    assert load_dtype(mixed, keys, fp32, None)[0] == torch.float32  # the config's
    no_dtype = build_config("tiny-llama")
    no_dtype.dtype = None
    target, note = load_dtype(mixed, keys, no_dtype, None)  # most elements
    assert target == torch.float16 and "e.g. a" in note and "1 in float32, 1 in float16" in note, note
