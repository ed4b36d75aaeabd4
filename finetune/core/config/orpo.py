"""Schema of ORPO's settings (`objective=orpo`): TRL's ORPOConfig field of the same name."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.config.checks import check_positive, choice
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.objectives import OBJECTIVES


@dataclass
class ORPOObjective(ObjectiveConfig):
    """Odds-ratio preference optimisation, with no reference model: `objective=orpo objective.beta=0.2`."""

    name: str = choice("orpo", OBJECTIVES)
    # The weight of the odds-ratio term beside the chosen answer's NLL (the paper's lambda, TRL's beta): the loss
    # is NLL(chosen) - beta x log sigmoid(log odds(chosen) - log odds(rejected)).
    beta: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("objective.beta", self.beta)
