"""Where the repository's files are, for tests at any depth."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
