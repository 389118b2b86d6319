"""Suite-wide settings."""

import gc


def pytest_collection_finish(session):
    """Leave what collection imported (torch, transformers, rewrite: millions of objects) out of the
    collector's walks: each full collection would otherwise visit them all, seconds over the suite."""
    gc.freeze()
