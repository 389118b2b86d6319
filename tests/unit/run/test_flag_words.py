"""The library names its parameters; the commands print their flags."""

from __future__ import annotations

import pytest

import rewrite
from rewrite.run.cli import main
from rewrite.run.flag_words import in_flags
from rewrite.run.presets import load_config
from tests.paths import ROOT


def test_backticked_parameters_become_flags_and_nothing_else_changes():
    assert in_flags("`batch_size` is 0; use a whole number of sequences >= 1") == (
        "--batch-size is 0; use a whole number of sequences >= 1")
    assert in_flags("(`world=16`, `global_batch` a multiple)") == "(--world 16, --global-batch a multiple)"
    assert in_flags("`step=N`, or leave `step` out") == "--step N, or leave --step out"
    assert in_flags("a `latest` file, `sharding=full`, plain text") == "a `latest` file, `sharding=full`, plain text"
    assert in_flags("keep fewer checkpoints (`keep`)") == "keep fewer checkpoints (--keep)"


def test_a_python_caller_reads_parameter_names_not_flags():
    config = load_config(ROOT / "tests" / "configs" / "llama-3.1-8b.json")
    for kwargs, name in (({"world": 0}, "world"), ({"world": 8, "global_batch": 0}, "global_batch")):
        with pytest.raises(ValueError) as raised:
            rewrite.suggest_plans(config, **kwargs)
        assert f"`{name}` is 0" in str(raised.value) and "--" not in str(raised.value)


def test_the_export_command_says_its_flag(tmp_path, capsys):
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / ".metadata").write_bytes(b"")
    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--step", "4"]) == 1
    err = capsys.readouterr().err
    assert "its saved steps: 3 (--step N, or leave --step out for the latest, 3)" in err, err
