"""Suite-wide settings."""

import gc

LAUNCHES = "tests/distributed/run/"


def pytest_collection_finish(session):
    """Leave what collection imported (torch, transformers, rewrite: millions of objects) out of the
    collector's walks: each full collection would otherwise visit them all, seconds over the suite."""
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """The end-to-end launches first: the longest unit of work (below) starts at once."""
    items.sort(key=lambda item: not item.nodeid.startswith(LAUNCHES))  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n N` (`make test` runs 2 workers): each file is one unit of work, so its module
    fixtures and caches are built once, and the end-to-end launches (torchrun and its workers, with
    timeouts of their own) are one unit, run one after another; units start in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return LAUNCHES if path.startswith(LAUNCHES) else path

    config.option.loadscopereorder = False
    return FileUnits(config, log)
