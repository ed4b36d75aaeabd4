"""Schema of RLOO's settings (`objective=rloo`): GRPO's rewards, rollout and generation, with RLOO's own baseline.

RLOO (REINFORCE leave-one-out, TRL's `RLOOTrainer`) samples `num_generations` completions per prompt as GRPO
does, but each completion's advantage is its reward less the mean reward of the other completions of its
prompt (no division by the group's spread), the KL to the reference is a penalty on the reward (beta x the
sequence's summed log-ratio) rather than a term of the loss, and the loss is one clipped ratio per sequence.
So every GRPO setting applies (and a learned reward model where GRPO takes one) except `loss_type`: RLOO's
loss has one form, `sequence`, and any other value is refused. Names follow TRL's `RLOOConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from finetune.core.config.checks import choice
from finetune.core.config.grpo import GRPOObjective
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES

# RLOO's one loss: the clipped policy ratio of each whole sequence times its advantage, averaged over sequences.
SEQUENCE_LOSS: str = "sequence"


@dataclass
class RLOOObjective(GRPOObjective):
    """REINFORCE leave-one-out: `objective=rloo objective.num_generations=4`. Every key of objective=grpo's
    section applies as well (rewards, rollout, generation), except `loss_type`; these are RLOO's own or its
    different defaults."""

    name: str = choice("rloo", OBJECTIVES)
    loss_types = (SEQUENCE_LOSS,)
    num_generations: int = 8
    """Completions sampled per prompt; each one's baseline is the mean reward of the others."""
    beta: float = 0.05
    """KL penalty on the reward (TRL's RLOO default): beta x the completion's summed log-ratio to the reference
    (with adapters: TRL's frozen copy of the adapter as training started) is subtracted from its reward; 0 runs
    no reference."""
    loss_type: str = SEQUENCE_LOSS
    """sequence only: TRL's RLOOTrainer has one loss, the clipped ratio of each whole completion times its
    advantage, averaged over the completions."""
    epsilon: float = 0.2
    """Clipping range of the per-sequence policy ratio (TRL's `epsilon`)."""
    normalize_advantages: bool = False
    """Scale the advantages of each generation batch to mean 0 and standard deviation 1."""
    reward_clip_range: Optional[list[float]] = None
    """[min, max]: each completion's summed reward clipped into this range before the baseline; None: unclipped."""

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(
                f"objective.num_generations={self.num_generations}: RLOO's leave-one-out baseline needs at least "
                "2 completions of a prompt"
            )
        super().__post_init__()
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"objective.epsilon={self.epsilon} must be between 0 and 1")
        clip = self.reward_clip_range
        if clip is not None and (len(clip) != 2 or not clip[0] < clip[1]):
            raise ConfigError(f"objective.reward_clip_range={list(clip)} must be [min, max] with min < max")
