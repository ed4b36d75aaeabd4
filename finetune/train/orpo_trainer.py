"""Odds-ratio preference optimisation: TRL's `ORPOTrainer` with an `ORPOConfig` built from the typed config and
the plan.

ORPO needs no reference model: its loss is the chosen answer's NLL minus beta x log sigmoid of the log odds
ratio of chosen over rejected, the odds read from each answer's mean per-token log-probability. The pairs
arrive tokenized from the data stage (the `preferences` record kind), laid out for TRL by
`reference_free.PairCollator`. TRL takes the model's whole logits of both rows (no fused head), which the plan
counts (`ObjectiveSpec.full_logits`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from finetune.core.config import Config
from finetune.planner import Plan
from finetune.train.reference_free import PairCollator, ReferenceFreeTrainer, config_kwargs, summary

with warnings.catch_warnings():
    from trl.import_utils import TRLExperimentalWarning

    # trl.experimental's notice that its APIs may change: the version is pinned (ARCHITECTURE.md), nothing to act on.
    warnings.filterwarnings("ignore", category=TRLExperimentalWarning)
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> ORPOConfig:
    """Every knob of the run in one place: the shared arguments plus ORPO's (`objective.beta`)."""
    kwargs = config_kwargs(cfg, plan, run_dir, compute_dtype)
    kwargs.update(
        beta=cfg.objective.beta,
        # The data stage applied the length limits; TRL reads this only when it generates.
        max_length=cfg.train.seq_len,
        disable_dropout=True,
    )
    return ORPOConfig(**kwargs)


class FinetuneORPOTrainer(ReferenceFreeTrainer, ORPOTrainer):
    """ORPOTrainer on the data stage's tokenized pairs, counting tokens for throughput."""


Trainer = FinetuneORPOTrainer


def trainer_kwargs(cfg: Config, plan: Plan, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    """ORPO's own arguments of the trainer: the pair collator, the held-out pairs when there are any."""
    return dict(
        data_collator=PairCollator(pad_token_id=tokenizer.pad_token_id),
        eval_dataset=eval_dataset if eval_dataset is not None and len(eval_dataset) else None,
    )


# TRL's logged ORPO metrics (trl/experimental/orpo/orpo_trainer.py), by the names metrics.json gives them.
_LOGGED = {
    "nll_loss": "nll_loss",
    "log_odds": "log_odds_chosen",  # log odds(chosen) - log odds(rejected), the batch mean
    "log_sigmoid_odds_ratio": "log_odds_ratio",  # log sigmoid of it: the term beta weighs
    "accuracy": "rewards/accuracies",
}


def objective_metrics(log_history: list[dict]) -> dict[str, Any]:
    """The odds ratio, its accuracy and the NLL over the logged steps (first, last, mean): did ORPO separate them."""
    return summary(log_history, _LOGGED)
