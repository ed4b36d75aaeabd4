"""Schemas of `plan` (the pre-flight planner's settings) and `smoke` (a short run on a sibling first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from finetune.core.config.checks import check_positive
from finetune.core.errors import ConfigError


@dataclass
class PlanConfig:
    """Pre-flight planner settings."""

    out: Optional[str] = None  # also write plan.json here
    # Fraction of each GPU kept free (allocator fragmentation, spikes) when judging fit.
    headroom: float = 0.10
    # Fraction of the profile's dense bf16 peak reached on the FLOPs a step executes (recomputation
    # included). null: the per-method figure fitted to GPU measurements (finetune/planner/calibration.json).
    mfu: Optional[float] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom < 0.9:
            raise ConfigError(f"plan.headroom={self.headroom} must be in [0, 0.9)")
        if self.mfu is not None and not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"plan.mfu={self.mfu} must be in (0, 1]")


@dataclass
class SmokeConfig:
    """`smoke=true`: the recipe's pipeline on its 8B sibling for a few steps before the real run."""

    enabled: bool = False
    steps: int = 200
    # The sibling recipe; `tiny` stands in where the model hub is unreachable.
    sibling: Optional[str] = None

    def __post_init__(self) -> None:
        check_positive("smoke.steps", self.steps)
