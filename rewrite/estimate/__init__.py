"""Numbers only, above `plan/`: activation and parameter memory per rank, and stage balance.

Pure: a resolved plan and its model (a meta-device one will do) in, bytes, counts and
warnings out; no process group. FLOPs per layer come from `rewrite.models.flops`.
"""

from .activations import RankActivations, rank_activations
from .balance import balance_warnings
from .memory import Footprint, RankMemory, footprint, rank_footprints, rank_memory

__all__ = [
    "rank_memory", "RankMemory", "rank_footprints", "Footprint", "footprint", "rank_activations", "RankActivations",
    "balance_warnings",
]
