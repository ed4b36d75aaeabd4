"""Pre-flight planner: will the job fit, how should it run, what does it cost. Pure: no torch."""

from finetune.planner.core import Alternative, Calibration, Estimate, Memory, Plan, Strategy, make_plan
from finetune.planner.params import ParamCounts, count_params, lora_params

__all__ = [
    "Alternative",
    "Calibration",
    "Estimate",
    "Memory",
    "ParamCounts",
    "Plan",
    "Strategy",
    "count_params",
    "lora_params",
    "make_plan",
]
