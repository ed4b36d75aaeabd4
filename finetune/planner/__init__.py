"""Pre-flight planner: will the job fit, how should it run, what does it cost. Pure: no torch.

contract (the Plan and its parts), params (exact counts), activations (the measured saved-bytes
formulas), memory (the memory model, as the trainer runs it: job, weights and step hold its terms), engines
(which engine runs which strategy), timing (step time, cost, disk), search (the fastest strategy that fits),
advice (the alternatives on other profiles and what would fit), plan (`make_plan`),
calibration (per-device constants). Scripts and tests use these modules' public names only.
"""

from finetune.planner.calibration import Calibration, DeviceCalibration
from finetune.planner.contract import Alternative, Estimate, Layout, Memory, Plan, Strategy
from finetune.planner.engines import ENGINES, why_not, why_not_split
from finetune.planner.job import Job, Runtime, make_job, runtime
from finetune.planner.memory import memory, tensors_gb
from finetune.planner.params import ParamCounts, count_params, lora_params
from finetune.planner.plan import make_plan
from finetune.planner.search import DEFAULT_CHUNKED_LOSS, candidates
from finetune.planner.timing import estimate, executed_flops_per_token, model_flops_per_token

__all__ = [
    "DEFAULT_CHUNKED_LOSS",
    "ENGINES",
    "Alternative",
    "Calibration",
    "DeviceCalibration",
    "Estimate",
    "Job",
    "Layout",
    "Memory",
    "ParamCounts",
    "Plan",
    "Runtime",
    "Strategy",
    "candidates",
    "count_params",
    "estimate",
    "executed_flops_per_token",
    "lora_params",
    "make_job",
    "make_plan",
    "memory",
    "model_flops_per_token",
    "runtime",
    "tensors_gb",
    "why_not",
    "why_not_split",
]
