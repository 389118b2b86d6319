"""The public API as a user meets it: what `rewrite` exports, as docs/api.md lists it, and its refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rewrite

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_docs_list_the_exports_in_order():
    listed = re.findall(r"^- `([A-Za-z_]\w*)", API_DOC.read_text(), flags=re.M)
    assert listed == rewrite.__all__, (
        "docs/api.md lists one line per name of rewrite.__all__, in its order: "
        f"missing {sorted(set(rewrite.__all__) - set(listed))}, not exported {sorted(set(listed) - set(rewrite.__all__))}"
    )
    for name in rewrite.__all__:
        assert getattr(rewrite, name) is not None, name


def test_every_refusal_is_a_rewrite_error_and_its_old_builtin(tmp_path):
    for cls, builtin in [(rewrite.PlanError, ValueError), (rewrite.InputError, ValueError),
                         (rewrite.CheckpointError, ValueError), (rewrite.NoPlanFits, ValueError),
                         (rewrite.LaunchError, RuntimeError)]:
        assert issubclass(cls, rewrite.RewriteError) and issubclass(cls, builtin), cls
    from rewrite.run.byte_data import TrainConfigError

    assert issubclass(TrainConfigError, rewrite.RewriteError) and issubclass(TrainConfigError, ValueError)
    with pytest.raises(rewrite.RewriteError, match="mesh"):
        rewrite.load_plan({"mesh": {"tp": 0}})
    (tmp_path / "latest").write_text("step-00000002")
    with pytest.raises(rewrite.CheckpointError, match="which is not a complete checkpoint"):
        rewrite.latest_checkpoint(tmp_path)
    with pytest.raises(rewrite.InputError, match="ids must be \\[batch, seq\\]"):
        rewrite.microbatches(torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(rewrite.InputError, match="torch.distributed is not initialised"):
        rewrite.from_pretrained(tmp_path, {"mesh": {"tp": 1}})


@pytest.mark.parametrize("name, advice", [("run_afab", "use rewrite.run_schedule"), ("Mesh", "a stage's is stage.mesh"),
                                          ("build_mesh", "apply_plan builds the mesh")])
def test_names_earlier_releases_exported_say_what_to_use(name, advice):
    assert name not in rewrite.__all__
    with pytest.raises(AttributeError, match=f"no attribute '{name}' \\(removed: .*{advice}"):
        getattr(rewrite, name)


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'run_afba'"):
        rewrite.run_afba  # noqa: B018
