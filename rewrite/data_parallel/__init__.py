"""Data parallelism over the mesh's dp dimension, on torch's own FSDP2 and replicate."""

from .apply import GradSync, apply_data_parallel

__all__ = ["GradSync", "apply_data_parallel"]
