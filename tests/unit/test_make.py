"""`make install` says what it is doing and refuses a Python older than the package needs."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def test_make_install_announces_each_step():
    dry = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    steps = [line for line in dry.stdout.splitlines() if line.startswith('echo "==> [')]
    assert [s.split("]")[0][-3:] for s in steps] == ["1/3", "2/3", "3/3"], dry.stdout
    assert "torch==2.13.0" in steps[1]


def test_make_refuses_a_python_older_than_3_11(tmp_path):
    old = tmp_path / "python3.10"
    old.write_text('#!/bin/sh\ncase "$1" in --version) echo "Python 3.10.12";; *) exit 1;; esac\n')
    old.chmod(0o755)
    venv = tmp_path / "venv"
    run = subprocess.run(["make", f"VENV={venv}", f"PYTHON={old}", f"{venv}/bin/python"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0
    assert f"rewrite needs Python >= 3.11; {old} is Python 3.10.12: make PYTHON=python3.11 ..." in run.stdout + run.stderr
    assert not venv.exists()
