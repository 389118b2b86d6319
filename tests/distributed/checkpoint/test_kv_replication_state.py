"""Checkpoints and gradient clipping under kv-head replication (tp past the kv heads: each kv head
held whole by tp / kv neighbouring tp ranks), each against one process: an HF save writes each kv
head once and loads under transformers and other plans; a training state resumes under other tp;
`clip_grad_norm_` counts each replicated gradient once.

A tiny LLaMA, 8 query heads over 2 kv heads of 8 (k_proj [16, 64]), at tp 4: r = 2, k/v cut into
2 slices of 8 rows, tp ranks 0, 1 holding slice 0 and ranks 2, 3 slice 1. Across plans no weight is
compared after an AdamW step (see test_training_state: AdamW turns reduction-order noise into
lr-sized differences); what is compared is the loaded tensors (a copy: bit for bit) and the loss of
the loaded weights before any update (a forward pass: ~1e-7)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import rewrite
from rewrite.checkpoint.training_state import load_training_state, save_training_state
from rewrite.run.parity import reference_step
from tests.asserts import assert_close
from tests.distributed.checkpoint.test_training_state import _differ, _snapshot
from tests.distributed.pipeline.test_grad_norm import _measure_and_clip
from tests.multiproc import run
from tests.reference import expected_shard

K_PROJ = "model.layers.0.self_attn.k_proj.weight"
# The plans a tp-4 checkpoint is loaded under, 4 ranks each: (tp, pp). kv 2 at tp 2: no replication.
PLANS = {"tp4": (4, 1), "tp2 x pp2": (2, 2), "tp1 x pp4": (1, 4)}


def _config(layers: int, kv: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=kv, head_dim=8)


def _model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """The same random weights on every rank (and in the test process) for the same seed."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _plan(config: LlamaConfig, tp: int, pp: int = 1):
    """The model's own HF tp plan (q/k/v, gate/up column; o, down row) on a mesh of tp x pp."""
    return rewrite.plan_from_hf(config, tp=tp, pp=pp, microbatches=2)


def _batch(config, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    ids = [torch.randint(0, config.vocab_size, (2, 10), generator=gen) for _ in range(2)]
    return ids, [torch.randint(0, config.vocab_size, (2, 10), generator=gen) for _ in ids]


def _not_reference(model, reference: dict) -> tuple[list[str], int]:
    """The parameters of a loaded rank that are not, bit for bit, their slice of the reference; how many compared."""
    params = list(model.named_parameters())
    return [n for n, p in params if not torch.equal(p.detach(), expected_shard(model, n, reference[n]))], len(params)


def _kv_shapes(model) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in model.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight"))}


def _hf_round_trip(rank: int, world: int, directory: str) -> dict:
    config = _config(layers=4)
    model = _model(config)
    reference = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    plan = _plan(config, tp=4)
    stage = rewrite.apply_plan(model, plan)
    out = {"kv_replicas": stage.mesh.kv_replicas, "reference": reference if rank == 0 else None}
    rewrite.save_pretrained(stage, plan, directory)
    out["loads"] = {}
    for name, (tp, pp) in PLANS.items():
        loaded = rewrite.from_pretrained(directory, _plan(config, tp=tp, pp=pp))
        differ, compared = _not_reference(loaded.model, reference)
        out["loads"][name] = {"differ": differ, "compared": compared, "kv": _kv_shapes(loaded.model)}
    return out


@pytest.mark.timeout(300)
def test_hf_save_writes_each_kv_head_once_and_loads_under_any_tp(tmp_path):
    directory = tmp_path / "hf"
    results = run(_hf_round_trip, 4, str(directory), timeout_s=240)
    reference = results[0]["reference"]
    assert all(r["kv_replicas"] == 2 for r in results), [r["kv_replicas"] for r in results]
    # The file holds every kv head once: k_proj and v_proj whole, [kv * head_dim, hidden].
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        stored = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert stored[K_PROJ] == stored[K_PROJ.replace("k_proj", "v_proj")] == [16, 64], stored[K_PROJ]
    # Plain transformers reads the reference model back, bit for bit.
    hf, info = AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    assert not {k: v for k, v in info.items() if v}, info
    weights = dict(hf.named_parameters(remove_duplicate=False))
    assert weights.keys() == reference.keys(), sorted(weights.keys() ^ reference.keys())
    assert [n for n, t in reference.items() if not torch.equal(weights[n].detach(), t)] == []
    # Loaded under tp 4 (replicated again), tp 2 and tp 1: each rank's shards are the reference's slices.
    rows = {"tp4": 8, "tp2 x pp2": 8, "tp1 x pp4": 16}  # k/v rows per rank: 16 / (tp / r)
    for rank, result in enumerate(results):
        for name, got in result["loads"].items():
            assert got["compared"] > 0 and got["differ"] == [], (rank, name, got["differ"])
            assert got["kv"] and {s[0] for s in got["kv"].values()} == {rows[name]}, (rank, name, got["kv"])


def _saved_chunks(path: Path, key: str) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """The whole size of `key` in a DCP checkpoint and its stored boxes (offsets, sizes), by offset."""
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata[key]
    return list(meta.size), sorted((list(c.offsets), list(c.sizes)) for c in meta.chunks)


def _resume(rank: int, world: int, root: str) -> dict:
    config, root = _config(layers=4), Path(root)
    ckpt, step_dir = root / "ckpt", root / "ckpt" / "step-00000001"
    model = _model(config)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, _plan(config, tp=4))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.01)
    ids, targets = _batch(config, 1)
    out = {"losses": [rewrite.run_schedule(stage, ids, targets).item(), reference_step(reference, ids, targets).item()]}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    save_training_state(ckpt, stage, optimizer, extra={"step": 1})
    at_save = _snapshot(stage, optimizer)
    out["next_loss"] = rewrite.run_schedule(stage, *_batch(config, 2)).item()  # the tp-4 run's step 2
    # What was saved, every tensor whole, as torch's own DCP reader (not rewrite's planners) reads it.
    if rank == 0:
        dcp_to_torch_save(step_dir, root / "saved.pt")
    dist.barrier()
    saved = torch.load(root / "saved.pt", weights_only=False)
    out["saved_differ"] = _differ(stage.model, at_save, saved)  # each rank's boxes where they belong
    out["chunks"] = {"model": _saved_chunks(step_dir, f"model/{K_PROJ}"),
                     "optim": _saved_chunks(step_dir, f"optim/{K_PROJ}/exp_avg_sq")}
    out["reshard"] = {}
    for name, (tp, pp) in PLANS.items():
        stage = rewrite.apply_plan(_model(config, seed=7), _plan(config, tp=tp, pp=pp))
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.01)
        extra = load_training_state(ckpt, stage, optimizer)
        loaded = _snapshot(stage, optimizer)
        out["reshard"][name] = {
            "extra": extra, "differ": _differ(stage.model, loaded, saved),
            "moments": sorted(k for k in loaded if k.startswith("optim/") and ".k_proj." in k),
            "loss": rewrite.run_schedule(stage, *_batch(config, 2)).item(),  # before any update
        }
    return out


@pytest.mark.timeout(300)
def test_training_state_saved_with_kv_replicas_resumes_under_other_tp(tmp_path):
    results = run(_resume, 4, str(tmp_path), timeout_s=240)
    config = _config(layers=4)
    next_loss = results[0]["next_loss"]
    # DCP wrote each replicated box once: k_proj (and its moments) as 2 boxes of 8 rows, not 4.
    boxes = ([16, 64], [([0, 0], [8, 64]), ([8, 0], [8, 64])])
    assert results[0]["chunks"] == {"model": boxes, "optim": boxes}, results[0]["chunks"]
    # One process with the saved weights: its step-2 loss is the tp-4 run's.
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    model = _model(config, seed=7)
    model.load_state_dict({k[len("model/"):]: v for k, v in saved.items() if k.startswith("model/")})
    with torch.no_grad():
        ids, targets = _batch(config, 2)
        one = sum(rewrite.causal_lm_loss(model(input_ids=x).logits, y) for x, y in zip(ids, targets)) / len(ids)
    assert abs(one.item() - next_loss) <= 1e-5, (one.item(), next_loss)
    for rank, out in enumerate(results):
        tp4, one_process = out["losses"]
        assert abs(tp4 - one_process) <= 1e-5, (rank, tp4, one_process)
        assert out["next_loss"] == next_loss, (rank, out["next_loss"], next_loss)
        assert out["saved_differ"] == [], (rank, out["saved_differ"])
        for name, got in out["reshard"].items():
            assert got["extra"] == {"step": 1}, (rank, name, got["extra"])
            assert got["differ"] == [], (rank, name, got["differ"])  # weights, both moments, step counts
            assert {k.rsplit("/", 1)[1] for k in got["moments"]} >= {"exp_avg", "exp_avg_sq"}, (rank, name, got)
            assert abs(got["loss"] - next_loss) <= 1e-5, (rank, name, got["loss"], next_loss)


def _clip(rank: int, world: int) -> dict:
    norms, replicas = [], []
    for name, kv in (("gqa 8/2 tp4", 2), ("mqa 8/1 tp4", 1)):
        config = _config(layers=2, kv=kv)
        model = _model(config)
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, _plan(config, tp=4))
        replicas.append(stage.mesh.kv_replicas)
        ids, targets = _batch(config, 1)
        loss = rewrite.run_schedule(stage, ids, targets)
        assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
        norms.append(_measure_and_clip(name, stage, stage.model, reference))
    return {"norms": norms, "replicas": replicas}


@pytest.mark.timeout(300)
def test_clip_grad_norm_counts_replicated_kv_gradients_once():
    results = run(_clip, 4, timeout_s=240)
    assert all(r["replicas"] == [2, 4] for r in results), [r["replicas"] for r in results]
    assert all(r["norms"] == results[0]["norms"] for r in results), [r["norms"] for r in results]
