"""Suite-wide settings."""

import gc
import os
import tempfile
from pathlib import Path

# Compiled blocks go to one cache for the whole suite (not the user's): a block compiled by one test is read
# by the next that compiles the same graph.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "rewrite-tests-compile-cache"))

LAUNCHES = "tests/distributed/run/"
# Launches that stop, interrupt or time out ranks on purpose: a unit of their own, beside the other launches.
STOPPING = {f"{LAUNCHES}test_{name}.py" for name in ("stuck_worker", "one_message", "interrupts", "launch_lifecycle")}


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or one of the two groups of end-to-end launches."""
    path = nodeid.split("::")[0]
    if path.startswith(LAUNCHES):
        return "launches that stop ranks" if path in STOPPING else "launches"
    return path


def pytest_collection_finish(session):
    """Leave what collection imported (torch, transformers, rewrite: millions of objects) out of the
    collector's walks: each full collection would otherwise visit them all, seconds over the suite."""
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """The end-to-end launches first: the longest units of work (below) start at once."""
    first = {"launches": 0, "launches that stop ranks": 1}
    items.sort(key=lambda item: first.get(_unit(item.nodeid), 2))  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n N` (`make test` runs 2 workers): each file is one unit of work, so its module
    fixtures and caches are built once; the end-to-end launches (torchrun and its workers, about half the
    suite's time) are two units, run one test after another, the first two to start; the other units
    start in collection order on whichever worker is free."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return Units(config, log)
