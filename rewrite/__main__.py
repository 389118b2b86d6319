"""`python -m rewrite ...` is the `rewrite` command."""

import gc

from .run.cli import console

gc.freeze()  # what the imports made lives as long as the process: left out of the collector's passes
console()
