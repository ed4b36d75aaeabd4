"""Schema of DPO's settings (`objective=dpo`): TRL's DPOConfig fields of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.config.checks import check_choices, check_positive, choice
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES

# TRL's DPO losses (trl/trainer/dpo_config.py's `loss_type`); one a run here.
DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)

# Where full fine-tuning's reference log-probabilities come from (adapters need neither: the base with the
# adapter disabled is the reference).
REFERENCE_SOURCES = (
    "auto",  # the planner chooses on memory and time
    "model",  # a frozen copy of the starting model beside the policy, sharded like it
    "precompute",  # one forward of the reference over the training pairs before training (TRL's precompute_ref_log_probs)
)


@dataclass
class DPOObjective(ObjectiveConfig):
    """Direct preference optimisation: `objective=dpo objective.beta=0.2`."""

    name: str = choice("dpo", OBJECTIVES)
    # The strength of the pull towards the reference: the implicit reward is beta x log(pi / pi_ref).
    beta: float = 0.1
    loss_type: str = choice("sigmoid", DPO_LOSSES)
    # Robust DPO's flip probability / EXO's epsilon (TRL's label_smoothing); exo_pair needs it above 0.
    label_smoothing: float = 0.0
    # Full fine-tuning: a frozen reference copy or precomputed log-probabilities (auto: the planner chooses).
    reference: str = choice("auto", REFERENCE_SOURCES)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self, "objective")
        check_positive("objective.beta", self.beta)
        check_positive("objective.label_smoothing", self.label_smoothing, allow_zero=True)
        if self.loss_type == "exo_pair" and self.label_smoothing == 0:
            raise ConfigError(
                "objective.loss_type=exo_pair needs objective.label_smoothing > 0 (the EXO paper uses 1e-3)"
            )
