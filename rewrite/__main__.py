"""`python -m rewrite ...` is the `rewrite` command."""

import sys

from .run.cli import main

sys.exit(main())
