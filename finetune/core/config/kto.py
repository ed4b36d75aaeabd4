"""Schema of KTO's settings (`objective=kto`): TRL's KTOConfig fields of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.config.checks import check_choices, check_positive, choice
from finetune.core.config.dpo import REFERENCE_SOURCES
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.objectives import OBJECTIVES

# TRL's KTO losses (trl/trainer/kto_config.py's `loss_type`): the KTO paper's, against a KL estimate of the
# batch, and APO-zero's unpaired variant, which needs none.
KTO_LOSSES = ("kto", "apo_zero_unpaired")


@dataclass
class KTOObjective(ObjectiveConfig):
    """Kahneman-Tversky optimisation: `objective=kto objective.desirable_weight=1.33`."""

    name: str = choice("kto", OBJECTIVES)
    # The strength of the pull towards the reference: the implicit reward is beta x log(pi / pi_ref).
    beta: float = 0.1
    loss_type: str = choice("kto", KTO_LOSSES)
    # Weights of the desirable and the undesirable examples' losses. With unequal counts, the KTO paper keeps
    # desirable_weight x desirable / (undesirable_weight x undesirable) between 1 and 4/3 (the trainer warns
    # outside it and says which values would be in it).
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # Full fine-tuning: a frozen reference copy or precomputed log-probabilities (auto: the planner chooses).
    reference: str = choice("auto", REFERENCE_SOURCES)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self, "objective")
        check_positive("objective.beta", self.beta)
        check_positive("objective.desirable_weight", self.desirable_weight)
        check_positive("objective.undesirable_weight", self.undesirable_weight)
