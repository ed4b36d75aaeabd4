"""RLOO through TRL's `RLOOTrainer`, on GRPO's wiring: the same prompts, rewards, rollout and generation modes.

TRL samples `num_generations` completions per prompt and scores them as GRPO does; the advantage of each is
its reward (less beta x its summed log-ratio to the reference, when beta > 0) minus the mean of the other
completions' rewards, and the loss is the clipped ratio of each whole completion times its advantage. What
is ours is GRPO's (imported from grpo_trainer.py: the trainer arguments, the rewards in TRL's calling
convention, the generation mode, the logged metrics' summary) plus the mapping of RLOO's own settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from trl import RLOOConfig, RLOOTrainer

from finetune.core.config import Config
from finetune.core.config.rloo import RLOOObjective
from finetune.core.rewards import Reward
from finetune.planner import Plan
from finetune.train import grpo_trainer
from finetune.train.base_trainer import RunTrainerMixin
from finetune.train.callbacks import RunMonitor

# What TRL logs is GRPO's (reward, reward_std, completions/*, kl, rewards/<name>/mean): the same summary.
objective_metrics = grpo_trainer.objective_metrics
# The rewards in TRL's calling convention, as GRPO passes them.
trainer_kwargs = grpo_trainer.trainer_kwargs


def rloo_arguments(rloo: RLOOObjective, rewards: Sequence[Reward], generation: str) -> dict[str, Any]:
    """RLOOConfig's own fields from ours: GRPO's (the rollout, the rewards' weights, generation) less the
    `loss_type` RLOOConfig has no field for (RLOO's loss has one form), plus RLOO's."""
    kwargs = grpo_trainer.grpo_arguments(rloo, rewards, generation)
    return _with_rloo_settings(kwargs, rloo)


def _with_rloo_settings(kwargs: dict[str, Any], rloo: RLOOObjective) -> dict[str, Any]:
    kwargs.pop("loss_type")
    kwargs.update(
        epsilon=rloo.epsilon,
        normalize_advantages=rloo.normalize_advantages,
        reward_clip_range=tuple(rloo.reward_clip_range) if rloo.reward_clip_range is not None else None,
    )
    return kwargs


def build_rloo_config(
    rloo: RLOOObjective,
    rewards: Sequence[Reward],
    output_dir: Path,
    *,
    generation: str,
    activation_checkpointing: bool = False,
    **training: Any,
) -> RLOOConfig:
    """TRL's `RLOOConfig` outside a run directory (tests, scripts): ours plus the Trainer arguments given."""
    return RLOOConfig(
        output_dir=str(output_dir),
        # RLOOConfig defaults the deprecated `gradient_checkpointing` to True; the new name, set, wins silently
        activation_checkpointing=activation_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if activation_checkpointing else None,
        **rloo_arguments(rloo, rewards, generation),
        **training,
    )


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> RLOOConfig:
    """GRPO's arguments for this run (the plan's batch shape in whole groups, the rewards, generation where the
    plan says), with RLOO's settings in place of GRPO's loss."""
    return RLOOConfig(
        **_with_rloo_settings(grpo_trainer.rollout_kwargs(cfg, plan, run_dir, compute_dtype), cfg.objective)
    )


class FinetuneRLOOTrainer(RunTrainerMixin, RLOOTrainer):
    """RLOOTrainer on the data stage's prompts, with the run's checkpoints and state."""

    def __init__(self, *args: Any, monitor: Optional[RunMonitor] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_run(monitor)
        self.companions = grpo_trainer.prepare_reward_model(self)


Trainer = FinetuneRLOOTrainer


def build_rloo_trainer(
    model: Any,
    tokenizer: Any,
    train_dataset: Any,
    rewards: Sequence[Reward],
    args: RLOOConfig,
    peft_config: Optional[Any] = None,
    callbacks: Optional[list[Any]] = None,
) -> RLOOTrainer:
    """TRL's trainer on our rewards outside a run directory (tests, scripts)."""
    return RLOOTrainer(
        model=model,
        reward_funcs=[grpo_trainer.trl_reward_function(r) for r in rewards],
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
