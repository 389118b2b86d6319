"""The cheap per-step checks decide exactly as the full ones, and the step clock's host path."""

from __future__ import annotations

import itertools

import torch

from rewrite import Stage, resolve
from rewrite.mesh import Mesh
from rewrite.pipeline import inputs as checks
from rewrite.pipeline.input_problems import local_problems
from rewrite.pipeline.timeline import StepClock, TimelineEvent
from rewrite.run.presets import build_model
from tests.multiproc import run


def _stage(first: bool, last: bool) -> Stage:
    """A tiny LLaMA's stage built by hand, without a process group: the first, the last, or both (vocabulary 256)."""
    model, pp = build_model("tiny-llama", device="meta"), 1 if first and last else 2
    mesh = Mesh(pp=pp, tp=1, rank=0 if first else 1, tp_group=None, tied_group=None)
    held = 0 if first else 1
    return Stage(model=model, module=model, resolved=resolve({"mesh": {"pp": pp}}, model), mesh=mesh,
                 forward_fns={held: model})


def _cases():
    ids = [torch.randint(0, 256, (2, 8)) for _ in range(2)]
    bad_id = [ids[0], ids[1].clone().index_fill_(1, torch.tensor([3]), 256)]
    negative = [ids[0].clone().fill_(-1), ids[1]]
    ignored = [ids[0].clone().fill_(-100), ids[1]]
    inputs = {"ids": ids, "bad id": bad_id, "negative": negative, "floats": [x.float() for x in ids],
              "3-d": [x[None] for x in ids], "empty list": [], "tensor": ids[0], "empty rows": [x[:0] for x in ids]}
    targets = {"ids": ids, "bad id": bad_id, "negative": negative, "ignored": ignored, "one": ids[:1],
               "None": None, "floats": [x.float() for x in ids], "other shape": [x[:, :4] for x in ids]}
    return inputs, targets


def test_fast_checks_refuse_exactly_what_the_full_checks_name():
    inputs, targets = _cases()
    losses = ((True, True), (False, True), (False, False))  # (default loss, counts tokens): the default, declared, other
    for (first, last), (default_loss, counting) in itertools.product(((True, False), (False, True), (True, True)), losses):
        stage = _stage(first, last)
        assert (stage.is_first, stage.is_last, stage.takes_token_ids, stage.vocab_size) == (first, last, True, 256)
        for (i_name, x), (t_name, t) in itertools.product(inputs.items(), targets.items()):
            full = local_problems(stage, x, t, default_loss, counting)
            facts = checks._facts(stage, checks._packed(x))
            fast = checks._structure_fails(facts, checks._layout(x), checks._layout(t), default_loss, counting)
            fast = fast or not checks._values_fit(stage, x, t, default_loss, counting)[0]
            assert fast == bool(full), (first, last, default_loss, counting, i_name, t_name, full)


def test_the_last_stage_counts_the_trained_tokens_in_the_same_read():
    inputs, targets = _cases()
    ignored = targets["ignored"]
    want = sum(int((t != -100).sum()) for t in ignored)
    assert 0 < want < sum(t.numel() for t in ignored)
    assert checks._values_fit(_stage(True, True), inputs["ids"], ignored, True, True) == (True, want)
    assert checks._values_fit(_stage(True, False), inputs["ids"], None, True, True) == (True, None)  # no targets read
    assert checks._values_fit(_stage(False, True), inputs["ids"], ignored, True, False) == (True, None)


def test_fingerprints_are_stable_and_tell_views_apart():
    assert checks._fingerprint("4 x [2, 16] int64") == checks._fingerprint("4 x [2, 16] int64")
    assert checks._fingerprint("4 x [2, 16] int64") != checks._fingerprint("4 x [4, 8] int64")
    assert 0 <= checks._fingerprint("x") < 2**62  # its negation fits int64 too


def test_the_host_clock_times_actions_in_wall_clock_seconds():
    clock = StepClock(torch.device("cpu"))
    start = clock.mark()
    clock.add(3, 1, 2, "forward", start, clock.mark())
    (event,) = clock.events()
    assert isinstance(event, TimelineEvent) and (event.rank, event.stage_idx, event.mb_idx, event.kind) == (3, 1, 2, "forward")
    assert 0 <= event.end - event.start < 1 and clock.events() is clock.events()  # read once, kept


def _disagreeing_checks(rank: int, world: int) -> str:
    inputs, targets = _cases()
    stage = _stage(True, True)
    counted = checks.check_step_inputs(stage, inputs["ids"], targets["ids"], default_loss=True, count_tokens=True)
    assert counted == 32, counted
    checks._verdict = lambda *args: (True, 32)  # as if the quick checks flagged what the full ones pass
    try:
        checks.check_step_inputs(stage, inputs["ids"], targets["ids"], default_loss=True, count_tokens=True)
    except RuntimeError as error:
        return str(error)
    return "trained on"


def test_checks_that_disagree_stop_the_step_instead_of_training_on():
    """Were the quick checks ever to flag inputs the full ones pass, the step stops (a bug, said as one):
    it never trains on with no agreed token count."""
    said = run(_disagreeing_checks, 1)[0]
    assert "the step's input checks disagree with each other" in said and "a bug in rewrite" in said, said
