"""Every example of README.md and docs/ runs: each Python block (under torchrun when its first line
says `# torchrun --nproc-per-node N`), each YAML block loads as a plan, and the `rewrite` commands of
README.md and docs/cli.md that train nothing (show, validate, plan, schema) exit 0."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from rewrite.plan.loading import load_plan
from tests.multiproc import run_script
from tests.paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
_TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+)\b")
_QUICK = ("show", "validate", "plan", "schema")  # the commands that train nothing: the rest have their own tests


def _blocks(language: str) -> list[tuple[str, int, str]]:
    """(file, line, code) of every fenced block in `language`."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            if match[1] == language:
                found.append((path.relative_to(ROOT).as_posix(), text.count("\n", 0, match.start()) + 1, match[2]))
    return found


PYTHON = _blocks("python")


def test_the_docs_have_their_examples_and_the_readme_is_a_front_page():
    assert len(PYTHON) >= 6, PYTHON
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{path.name})" in readme, f"README does not point to docs/{path.name}"
    internal = [code for _, _, code in PYTHON if re.search(r"from rewrite\.\w+|import rewrite\.\w+", code)]
    assert not internal, "examples use the public API only (rewrite.*), not internal modules"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where,code", [(f"{f}:{line}", code) for f, line, code in PYTHON])
def test_python_example_runs(where, code, tmp_path):
    """Each example as its first line says: under torchrun's environment on that many ranks, else in one
    process; README's through torchrun itself, the rest forked from the suite's preloaded ranks."""
    script = tmp_path / "example.py"
    script.write_text(code)
    launch = _TORCHRUN.match(code)
    shutil.rmtree(ROOT / "out" / "docs", ignore_errors=True)  # what the examples write, from scratch each time
    try:
        if where.startswith("README.md"):
            cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={launch[1]}"]
                                     if launch else []), str(script)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
            assert run.returncode == 0, f"{where}:\n{run.stdout[-3000:]}\n{run.stderr[-4000:]}"
        else:
            run_script(str(script), int(launch[1]) if launch else 1, cwd=str(ROOT), timeout_s=280)
    finally:
        shutil.rmtree(ROOT / "out" / "docs", ignore_errors=True)


@pytest.mark.parametrize("where,code", [(f"{f}:{line}", code) for f, line, code in _blocks("yaml")])
def test_yaml_example_is_a_plan(where, code):
    load_plan(__import__("yaml").safe_load(code) or {})


def _commands() -> list[list[str]]:
    """The `rewrite ...` lines of README.md and docs/cli.md whose command is one of `_QUICK` (comments and a
    redirection dropped)."""
    out = []
    for _, _, code in [b for b in _blocks("bash") if b[0] in ("README.md", "docs/cli.md")]:
        for line in code.splitlines():
            words = shlex.split(line, comments=True)
            words = words[:words.index(">")] if ">" in words else words
            if words[:1] == ["rewrite"] and len(words) > 1 and words[1] in _QUICK:
                out.append(words)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("words", _commands(), ids=lambda w: " ".join(w[1:5]))
def test_readme_command_runs(words, capsys, monkeypatch):
    # In this process, as the console script runs it (`rewrite.run.cli.main`): these commands start no
    # process group, and a fresh interpreter for each would spend its time importing torch.
    from rewrite.run.cli import main

    monkeypatch.chdir(ROOT)
    status = main(words[1:])
    said = capsys.readouterr()
    assert status == 0, f"{' '.join(words)}:\n{said.out[-2000:]}\n{said.err[-2000:]}"
