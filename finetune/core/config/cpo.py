"""Schemas of CPO's and SimPO's settings (`objective=cpo`, `objective=simpo`): TRL's CPOConfig fields of the
same names. SimPO is CPO's `loss_type="simpo"`: the length-normalised log-probability margin against a target
margin `simpo_gamma`. Both run TRL's CPOTrainer with no reference model. `length_normalised` and
`target_margin` say how the reward is read, for the evaluation's scores."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.config.checks import check_choices, check_positive, choice
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES

# TRL's CPO losses (trl/experimental/cpo/cpo_config.py's `loss_type`; SimPO is its own objective here).
CPO_LOSSES = ("sigmoid", "hinge", "ipo")


def _check_label_smoothing(value: float) -> None:
    check_positive("objective.label_smoothing", value, allow_zero=True)
    if value >= 0.5:
        raise ConfigError(f"objective.label_smoothing={value} must be below 0.5 (a flip probability)")


@dataclass
class CPOObjective(ObjectiveConfig):
    """Contrastive preference optimisation: `objective=cpo objective.beta=0.1 objective.cpo_alpha=1.0`."""

    name: str = choice("cpo", OBJECTIVES)
    # The scale of the reward beta x log pi(answer | prompt) whose margin the loss pushes up.
    beta: float = 0.1
    loss_type: str = choice("sigmoid", CPO_LOSSES)
    # The weight of the chosen answer's NLL (behaviour cloning) beside the preference loss.
    cpo_alpha: float = 1.0
    # Robust CPO's flip probability (TRL's label_smoothing; the sigmoid loss only).
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self, "objective")
        check_positive("objective.beta", self.beta)
        check_positive("objective.cpo_alpha", self.cpo_alpha, allow_zero=True)
        _check_label_smoothing(self.label_smoothing)

    @property
    def length_normalised(self) -> bool:
        """The reward is the answer's mean per-token log-probability, not its sum (TRL averages for IPO)."""
        return self.loss_type == "ipo"

    @property
    def target_margin(self) -> float:
        """The reward margin the loss aims past: none for CPO."""
        return 0.0


@dataclass
class SimPOObjective(ObjectiveConfig):
    """Simple preference optimisation: `objective=simpo objective.beta=2.0 objective.simpo_gamma=0.5`."""

    name: str = choice("simpo", OBJECTIVES)
    # The reward is beta x the answer's mean per-token log-probability (the SimPO paper uses 2 to 10; TRL's 0.1
    # default is CPO's).
    beta: float = 2.0
    # The target reward margin: the loss is -log sigmoid(beta x (mean log p(chosen) - mean log p(rejected)) - gamma).
    simpo_gamma: float = 0.5
    # The weight of the chosen answer's NLL beside the SimPO loss: 0 is SimPO as published, above 0 CPO-SimPO.
    cpo_alpha: float = 0.0
    # Robust SimPO's flip probability (TRL's label_smoothing).
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("objective.beta", self.beta)
        check_positive("objective.simpo_gamma", self.simpo_gamma, allow_zero=True)
        check_positive("objective.cpo_alpha", self.cpo_alpha, allow_zero=True)
        _check_label_smoothing(self.label_smoothing)

    @property
    def length_normalised(self) -> bool:
        """The reward is the answer's mean per-token log-probability."""
        return True

    @property
    def target_margin(self) -> float:
        """The reward margin the loss aims past (gamma)."""
        return self.simpo_gamma

    @property
    def loss_type(self) -> str:
        """TRL's CPO loss this objective runs."""
        return "simpo"
