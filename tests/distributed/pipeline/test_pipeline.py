"""Pipeline stages and the AFAB runner against a single-process reference."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import rewrite
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.multiproc import run
from tests.reference import assert_grads_match


def _batch(config, microbatches: int, mb: int = 2, seq: int = 10, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, config.vocab_size, (mb, seq), generator=gen) for _ in range(microbatches)]
    targets = [torch.randint(0, config.vocab_size, (mb, seq), generator=gen) for _ in range(microbatches)]
    targets[0][0, :3] = -100  # ignored positions are honoured
    return ids, targets


def assert_afab_order(timeline) -> None:
    forwards = [e for e in timeline if e.kind == "forward"]
    backwards = [e for e in timeline if e.kind == "backward"]
    assert forwards and len(forwards) == len(backwards), timeline
    assert max(e.end for e in forwards) <= min(e.start for e in backwards), "a backward started before a forward"
    assert [e.mb_idx for e in forwards] == list(range(len(forwards)))


def _pipeline(rank: int, ws: int, mesh: dict, microbatches: int, cut_points, overrides: dict) -> dict:
    config = build_config("tiny-llama", **overrides)
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    tp_rules = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel if mesh.get("tp", 1) > 1 else {}
    plan = {"mesh": mesh, "tensor_parallel": tp_rules, "pipeline": {"microbatches": microbatches}}
    if cut_points is not None:
        plan["pipeline"]["cut_points"] = cut_points
    layer_refs = [weakref.ref(layer) for layer in model.model.layers]
    stage = rewrite.apply_plan(model, plan)
    gc.collect()
    alive = [str(i) for i, ref in enumerate(layer_refs) if ref() is not None]
    kept = list(model.model.layers.keys()) if isinstance(model.model.layers, torch.nn.ModuleDict) else alive
    assert alive == kept, f"unowned layers were not released: alive {alive}, owned {kept}"
    ids, targets = _batch(config, microbatches)
    loss = rewrite.run_schedule(stage, ids, targets)
    ref_loss = reference_step(reference, ids, targets)
    assert_close(f"rank {rank} step loss", loss, ref_loss)
    assert_grads_match(model, reference, prefix=f"rank {rank} ")
    assert_afab_order(stage.timeline)
    spec = stage.resolved.stages[stage.stage_ids[0]]  # one stage per rank
    owned = sorted({n.split(".")[2] for n, _ in model.named_parameters() if n.startswith("model.layers.")})
    # Tied copies stay equal after an optimizer step.
    torch.optim.SGD(stage.parameters(), lr=0.1).step()
    tied = [p.detach().clone() for p in stage.tied]
    return {"layers": owned, "modules": list(spec.modules), "first": stage.is_first, "last": stage.is_last,
            "params": sorted(n for n, _ in model.named_parameters()), "tied": tied}


CASES = {
    # name: (world, mesh, microbatches, cut_points, config overrides)
    "pp2": (2, {"pp": 2}, 4, None, {}),
    "pp3-uneven-balanced": (3, {"pp": 3}, 3, None, {}),
    "pp4-one-microbatch": (4, {"pp": 4}, 1, None, {}),
    "pp4-fewer-microbatches": (4, {"pp": 4}, 2, None, {}),
    "pp2-uneven-cut": (2, {"pp": 2}, 3, ["model.layers.1"], {}),
    # A 16k vocabulary: the head weighs over three layers (at the default seq_len), so auto cuts 3 + 1.
    "pp2-auto": (2, {"pp": 2}, 2, "auto", {"vocab_size": 16384}),
    "tp2xpp2": (4, {"pp": 2, "tp": 2}, 4, ["model.layers.2"], {}),
    "pp2-tied": (2, {"pp": 2}, 2, None, {"tie_word_embeddings": True}),
    "tp2xpp2-tied": (4, {"pp": 2, "tp": 2}, 2, None, {"tie_word_embeddings": True}),
    "pp1-accumulation": (1, {"pp": 1}, 3, None, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_reference(case):
    world, mesh, microbatches, cuts, overrides = CASES[case]
    results = run(_pipeline, world, mesh, microbatches, cuts, overrides, timeout_s=180)
    tp = mesh.get("tp", 1)
    stages = [results[r] for r in range(0, world, tp)]
    # Stages partition the layers in order; embeddings first, norm and head last.
    layers = [l for s in stages for l in s["layers"]]
    assert layers == ["0", "1", "2", "3"], layers
    if case == "pp3-uneven-balanced":
        assert [s["layers"] for s in stages] == [["0", "1"], ["2"], ["3"]]
    if case == "pp2-uneven-cut":
        assert [s["layers"] for s in stages] == [["0"], ["1", "2", "3"]]
    if case == "pp2-auto":
        assert [s["layers"] for s in stages] == [["0", "1", "2"], ["3"]]
    for s in stages:
        has_embed = "model.embed_tokens.weight" in s["params"]
        has_head = "lm_head.weight" in s["params"] or (overrides and s["last"] and "model.embed_tokens.weight" in s["params"])
        assert has_embed == s["first"] or overrides.get("tie_word_embeddings"), s["params"][:3]
        assert ("model.norm.weight" in s["params"]) == s["last"], s
        assert s["modules"][-1] in (("lm_head",) if s["last"] else tuple(f"model.layers.{l}" for l in s["layers"])), s
        assert has_head or not s["last"], s
    if overrides.get("tie_word_embeddings"):
        for t in range(tp):
            first, last = results[t]["tied"], results[(mesh["pp"] - 1) * tp + t]["tied"]
            assert len(first) == len(last) == 1
            assert torch.equal(first[0], last[0]), "tied embedding copies diverged after an optimizer step"
