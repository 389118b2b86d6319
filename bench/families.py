"""The family table: every Hugging Face family the sweep covers, at tp 2 and pp 2, from the sweep's own results.

    .venv/bin/python -m bench.families      # about 3 minutes on 2 cores; writes docs/families.md

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


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(results: dict[str, dict[str, str]], transformers_version: str) -> str:
    both = sum(all(v == "works" for v in r.values()) for r in results.values())
    tp = sum(r.get("tp2") == "works" for r in results.values())
    lines = [
        "# Hugging Face families",
        "",
        f"Every dense decoder-only causal LM of transformers {transformers_version} whose `base_model_tp_plan` "
        "uses only styles rewrite maps, built tiny from its own config (hidden 64, 4 layers, random weights), "
        "one training step at tp 2 (the family's own `base_model_tp_plan`) and at pp 2 (1f1b), the loss and "
        "every gradient compared with one process running the model's own forward. A case either works or "
        "is refused on every rank before anything runs, with the reason below; none trains silently wrong.",
        "",
        f"{both} of {len(results)} work at tp 2 and at pp 2; {tp} at tp 2. Written by `python -m bench.families` "
        f"on {date.today().isoformat()} from `{SWEEP}`.",
        "",
        "| family | tp 2 | pp 2 (1f1b) |",
        "|---|---|---|",
    ]
    for family, result in sorted(results.items()):
        lines.append(f"| `{family}` | {_cell(result.get('tp2', '-'))} | {_cell(result.get('pp2', '-'))} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "families.json"
        env = {**os.environ, "REWRITE_FAMILY_TABLE": str(table)}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", SWEEP], cwd=ROOT, env=env)
        if not table.exists():
            print("the sweep wrote no results", file=sys.stderr)
            return 1
        results = json.loads(table.read_text())
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(render(results, transformers.__version__))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(results)} families" + ("" if run.returncode == 0 else " (some cases failed)"))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
