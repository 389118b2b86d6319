"""Data parallelism over the mesh's dp dimension, on torch's own FSDP2, replicate and DDP."""

from .apply import GradSync, apply_data_parallel
from .ddp import DdpSync

__all__ = ["DdpSync", "GradSync", "apply_data_parallel"]
