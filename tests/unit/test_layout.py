"""The package's import rules, read from the source: imports only go downwards.

A unit is a folder of `rewrite/` or one of its top-level modules. A module may import
its own unit and units of a lower level, never a unit above or beside it; so, with
`models/`, `schedules/`, `plan/` and `estimate/` free of `torch.distributed`, binding a
plan and estimating its cost need no process group even through what they import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGE = ROOT / "rewrite"

LEVELS = {
    "models": 0,  # model families: the HF LLaMA walker, fx graphs, FLOPs per layer from a config
    "schedules": 0,  # pure tables: Action, the named schedules, check / simulate, CSV
    "lent": -1,  # temporaries handed to collectives, waited for at exit
    "torch_internals": -1,  # every private torch call, checked on one release
    "values": -1,  # ints that are not bools, counts: checked alike everywhere
    "errors": -1,  # RewriteError and its kinds: every refusal
    "doing": -1,  # what this rank is doing, named for a report when a wait fails
    "grad_finish": 1.9,  # how a step's gradients are completed: the protocol every finisher follows, one flat sum
    "agreement": 2,  # ranks share what they found before they talk
    "plan": 1,  # what a plan is: schema, files, loading, HF tp_plan import, patterns, size checks
    "binding": 1.5,  # what a plan binds to on a model: resolve, tp rules and shapes, shard layout, stage cuts
    "estimate": 2,  # numbers only: activations, memory, stage balance
    "mesh": 2,  # the only place process groups are made (the rank formula is plan.ranks)
    "lora": 2.5,  # low-rank adapters: their arithmetic, the plain layer carrying one, putting a plan's on
    "tensor_parallel": 3,
    "expert_parallel": 3.2,  # experts split over ep, the all-to-all token dispatch, their gradients
    "context_parallel": 3.5,  # sequence shards, the K/V all-gather, the attention function
    "pipeline": 4,
    "data_parallel": 4.5,  # FSDP2 / replicate units and the once-per-step gradient sync
    "compiled": 4.8,  # torch.compile on the plan's blocks, the compile cache
    "rewriter": 5,  # apply_plan: bind, then tp, then stages
    "checkpoint": 6,
    "train_step": 6,
    "run": 7,  # CLI, `show`, train loop, launcher, presets, parity
    "__init__": 8,  # the public API re-exports everything
    "__main__": 8,
}
NO_PROCESS_GROUP = {"models", "schedules", "plan", "binding", "estimate"}


def units() -> set[str]:
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    return folders | {p.stem for p in PACKAGE.glob("*.py")}


def imported_modules(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import anywhere in the file, relative ones made absolute.

    `from a import b` yields both `a` and `a.b`, so `from torch import distributed` is seen.
    """
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def unit_of_module(dotted: str, known: set[str]) -> str | None:
    parts = dotted.split(".")
    if parts[0] != "rewrite":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in known else "__init__"


def problems_in(relpath: str, source: str, known: set[str]) -> list[str]:
    """Every import of the file at `relpath` (under rewrite/) that breaks the rules."""
    path = Path(relpath)
    unit = path.parts[0].removesuffix(".py")
    package = ".".join(["rewrite", *path.parts[:-1]])
    problems: dict[tuple[int, str], str] = {}  # one per import statement and rule
    for line, dotted in imported_modules(ast.parse(source), package):
        where = f"rewrite/{relpath}:{line}"
        if unit in NO_PROCESS_GROUP and (dotted == "torch.distributed" or dotted.startswith("torch.distributed.")):
            problems.setdefault((line, "dist"), f"{where} imports {dotted}: {unit}/ must work without a process group")
        target = unit_of_module(dotted, known)
        if target is not None and target != unit and LEVELS[target] >= LEVELS[unit]:
            problems.setdefault(
                (line, target),
                f"{where} imports {dotted}: {unit} (level {LEVELS[unit]}) may only import units below it, "
                f"not {target} (level {LEVELS[target]})",
            )
    return list(problems.values())


def test_every_unit_has_a_level():
    assert units() == set(LEVELS), (
        "give each folder and top-level module of rewrite/ a level in LEVELS (and drop levels of removed ones): "
        f"unplaced {sorted(units() - set(LEVELS))}, gone {sorted(set(LEVELS) - units())}"
    )


def test_imports_only_go_downwards():
    known, problems = units(), []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    for path in files:
        problems += problems_in(str(path.relative_to(PACKAGE)), path.read_text(), known)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("relpath", "source", "expected"),
    [
        ("binding/resolve.py", "import torch.distributed as dist", "must work without a process group"),
        ("plan/schema.py", "from torch import distributed", "must work without a process group"),
        ("models/hf_decoder.py", "def f():\n    from torch.distributed import ProcessGroup", "without a process group"),
        ("binding/resolve.py", "from ..mesh import build_mesh", "not mesh"),
        ("binding/resolve.py", "from ..estimate.memory import rank_memory", "not estimate"),
        ("schedules/table.py", "from ..plan.schema import PlanError", "not plan"),
        ("schedules/named.py", "import torch.distributed", "must work without a process group"),
        ("estimate/memory.py", "from ..pipeline.stage import Stage", "not pipeline"),
        ("estimate/balance.py", "from torch.distributed import ProcessGroup", "must work without a process group"),
        ("estimate/activations.py", "from ..run.show.report import format_plan", "not run"),
        ("models/flops.py", "from ..binding.resolve import ResolvedPlan", "not binding"),
        ("plan/loading.py", "from ..binding.resolve import resolve", "not binding"),
        ("binding/resolve.py", "from ..tensor_parallel.layers import ColumnParallelLinear", "not tensor_parallel"),
        ("tensor_parallel/layers.py", "from ..pipeline import stage", "not pipeline"),
        ("tensor_parallel/apply.py", "import rewrite.pipeline.stage", "not pipeline"),
        ("pipeline/runner.py", "from ..rewriter import apply_plan", "not rewriter"),
        ("checkpoint/hf_save.py", "from ..run.presets import build_model", "not run"),
        ("rewriter.py", "from .run import cli", "not run"),
        ("run/cli.py", "from .. import apply_plan", "not __init__"),
        ("checkpoint/hf_load.py", "from ..train_step import train_step_pipeline_afab", "not train_step"),
    ],
)
def test_the_rules_catch_an_upward_import(relpath, source, expected):
    (problem,) = problems_in(relpath, source, units())
    assert expected in problem and f"rewrite/{relpath}" in problem


def test_the_rules_allow_downward_and_outside_imports():
    known = units()
    assert problems_in("pipeline/carve.py", "from ..tensor_parallel.layers import ColumnParallelLinear", known) == []
    assert problems_in("binding/resolve.py", "from ..models import fx_graph\nimport torch\nfrom torch import nn", known) == []
    assert problems_in("binding/resolve.py", "from ..schedules import placement", known) == []
    assert problems_in("estimate/memory.py", "from ..binding.resolve import ResolvedPlan\nfrom ..schedules import plan_table", known) == []
    assert problems_in("pipeline/runner.py", "from ..schedules import Action", known) == []
    assert problems_in("run/show/report.py", "from ...estimate.memory import rank_memory", known) == []
    assert problems_in("run/train.py", "import torch.distributed as dist\nfrom .presets import build_model", known) == []
    assert problems_in("__init__.py", "from .run.launch import launch", known) == []
