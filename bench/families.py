"""The family tables: every Hugging Face family the sweeps cover, from the sweeps' own results.

    .venv/bin/python -m bench.families        # about 5 minutes on 2 cores; writes docs/families.md
    .venv/bin/python -m bench.families --moe  # the mixture-of-experts families: docs/moe_families.md

Runs tests/distributed/test_family_sweep.py (each family tiny, one spawn of 2 ranks, the step
loss and every gradient against one process) with REWRITE_FAMILY_TABLE set, then writes what
each case found: `works`, or the refusal every rank gave before anything ran, or why no tiny
model of the family could be built from its config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "families.md"
SWEEP = "tests/distributed/test_family_sweep.py"
MOE_OUT = ROOT / "docs" / "moe_families.md"
MOE_SWEEP = "tests/distributed/expert_parallel/test_moe_family_sweep.py"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


COLUMNS = {"tp2": "tp 2", "pp2": "pp 2 (1f1b)", "sp": "tp 2 + sequence parallel", "vocab_loss": "tp 2 + vocab/loss parallel",
           "kv_replicated": "tp 2, 1 kv head (replicated)"}


def render(results: dict[str, dict[str, str]], transformers_version: str) -> str:
    lines = [
        "# Hugging Face families",
        "",
        f"Every dense decoder-only causal LM of transformers {transformers_version} whose `base_model_tp_plan` "
        "uses only styles rewrite maps, built tiny from its own config (hidden 64, 4 layers, random weights), "
        "one training step at tp 2 (the family's own `base_model_tp_plan`), at pp 2 (1f1b), at tp 2 with "
        "sequence parallelism, and at tp 2 with the LM head split by vocabulary and the loss computed on the "
        "shards (`plan_from_hf(..., loss_parallel=True)`), and at tp 2 with one kv head and only the attention "
        "split (multi-query: each rank holds the kv head whole), the loss and every gradient compared with one "
        "process running the model's own forward. A case either works or is refused on every rank before "
        "anything runs, with the reason below; none trains silently wrong.",
    ]
    return _table(lines, results, COLUMNS, ("tp2", "pp2"), "", SWEEP)


def _works(cell: str | None) -> bool:
    """A case that works as it would for a user (a note on how, not one that it ran in eval mode)."""
    return cell == "works" or (cell or "").startswith("works (") and "eval mode" not in cell


def _table(lines: list[str], results: dict[str, dict[str, str]], columns: dict[str, str], pair: tuple[str, str],
           flag: str, sweep: str) -> str:
    """`lines` (title and what was run), then how many work at both cases of `pair` and at each column, and
    the table: a row a family, a column a case."""
    both = sum(all(_works(r.get(k)) for k in pair) for r in results.values())
    counts = ", ".join(f"{sum(_works(r.get(k)) for r in results.values())} at {v}" for k, v in columns.items())
    lines = [
        *lines,
        "",
        f"{both} of {len(results)} work at {columns[pair[0]]} and at {columns[pair[1]]}; {counts}. Written by "
        f"`python -m bench.families{flag}` on {date.today().isoformat()} from `{sweep}`.",
        "",
        "| family | " + " | ".join(columns.values()) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for family, result in sorted(results.items()):
        lines.append(f"| `{family}` | " + " | ".join(_cell(result.get(k, "-")) for k in columns) + " |")
    return "\n".join(lines) + "\n"


MOE_COLUMNS = {"ep2": "ep 2 (dp 2)", "pp2": "pp 2 (1f1b)", "tp2": "tp 2 (plan_from_hf)",
               "ep2 x tp2": "ep 2 x tp 2 (plan_from_hf)"}


def render_moe(results: dict[str, dict[str, str]], transformers_version: str) -> str:
    lines = [
        "# Hugging Face mixture-of-experts families",
        "",
        f"Every mixture-of-experts causal LM of transformers {transformers_version} (an ep plan, or a count of "
        "experts in its config; no sub-models), built tiny from its own config (hidden 64, 4 layers, 4 experts "
        "of width 32, 2 chosen per token, random weights), one training step at ep 2 (dp 2, its experts "
        "modules split by expert: docs/expert_parallel.md), at pp 2 (1f1b), at tp 2 (its own tp plan through "
        "`plan_from_hf`: the attention split, and each expert split over tp where the family's tp plan splits it "
        "and its experts add up so split, else the experts whole; the cell says which) and at ep 2 x tp 2 "
        "(`plan_from_hf(model, tp=2, ep=2)` on 2 ranks: the attention split by tp, the experts by ep over the "
        "same two ranks, each sending its half of the tokens), the loss and every gradient compared with "
        "one process running the model's own forward. A case either works or is refused on every rank before "
        "anything runs, with the reason below; none trains silently wrong.",
    ]
    return _table(lines, results, MOE_COLUMNS, ("ep2", "pp2"), " --moe", MOE_SWEEP)


def main() -> int:
    import transformers

    moe = "--moe" in sys.argv[1:]
    sweep, out, key = (MOE_SWEEP, MOE_OUT, "REWRITE_MOE_TABLE") if moe else (SWEEP, OUT, "REWRITE_FAMILY_TABLE")
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "families.json"
        env = {**os.environ, key: str(table)}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", sweep], cwd=ROOT, env=env)
        if not table.exists():
            print("the sweep wrote no results", file=sys.stderr)
            return 1
        results = json.loads(table.read_text())
    out.parent.mkdir(exist_ok=True)
    out.write_text((render_moe if moe else render)(results, transformers.__version__))
    print(f"wrote {out.relative_to(ROOT)}: {len(results)} families" + ("" if run.returncode == 0 else " (some cases failed)"))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
