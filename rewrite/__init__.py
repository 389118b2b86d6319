"""rewrite: declarative tensor- and pipeline-parallel rewriting of PyTorch models."""

from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
__version__ = "0.1.0"
