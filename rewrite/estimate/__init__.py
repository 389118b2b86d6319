"""Numbers only, above `plan/`: activation and parameter memory per rank, stage balance, step time on
a hardware profile, and the plan search.

Pure: a resolved plan and its model (a meta-device one will do) in, bytes, seconds, counts and
warnings out; no process group. FLOPs per layer come from `rewrite.models.flops`.
"""

from .activations import RankActivations, rank_activations
from .balance import balance_warnings
from .hardware import HARDWARE_NAMES, Hardware, load_hardware
from .memory import Footprint, RankMemory, footprint, rank_footprints, rank_memory
from .search import Candidate, NoPlanFits, suggest_plans
from .stage_time import StageTimes, stage_times
from .step_time import StepPrediction, predict_step

__all__ = [
    "rank_memory", "RankMemory", "rank_footprints", "Footprint", "footprint", "rank_activations", "RankActivations",
    "balance_warnings", "Hardware", "HARDWARE_NAMES", "load_hardware", "StageTimes", "stage_times", "StepPrediction",
    "predict_step", "Candidate", "NoPlanFits", "suggest_plans",
]
