"""`python -m rewrite ...` is the `rewrite` command."""

import sys

from .cli import main

sys.exit(main())
