"""Data parallelism over the mesh's dp dimension, on torch's own FSDP2, replicate and DDP."""

from .apply import DdpSync, GradSync, apply_data_parallel

__all__ = ["DdpSync", "GradSync", "apply_data_parallel"]
