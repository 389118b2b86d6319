"""`python -m rewrite ...` is the `rewrite` command."""

from .run.cli import console

console()
