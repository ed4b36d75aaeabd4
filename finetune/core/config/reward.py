"""Schema of reward modelling's settings (`objective=reward`): TRL's RewardConfig fields of the same names.

A reward model is the base with a sequence-classification head (one score a sequence, read at its last
token) in place of the LM head, trained on preference pairs so that the chosen sequence scores above the
rejected one (TRL's RewardTrainer: -log sigmoid(score_chosen - score_rejected)). No reference model runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from finetune.core.config.checks import check_positive, choice
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.objectives import OBJECTIVES


@dataclass
class RewardObjective(ObjectiveConfig):
    """Reward modelling: `objective=reward`."""

    name: str = choice("reward", OBJECTIVES)
    center_rewards_coefficient: Optional[float] = None
    """Weight of the mean squared score added to the loss, which keeps the scores centred on zero (TRL's
    `center_rewards_coefficient`; the paper's value is 0.01); None: no such term."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.center_rewards_coefficient is not None:
            check_positive("objective.center_rewards_coefficient", self.center_rewards_coefficient)
