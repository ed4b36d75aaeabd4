"""Contrastive and simple preference optimisation: TRL's `CPOTrainer` with a `CPOConfig` built from the typed
config and the plan, for `objective=cpo` and `objective=simpo` (CPO's `loss_type="simpo"`).

Neither has a reference model. CPO's loss is the DPO loss on the policy's own summed log-probabilities plus
`cpo_alpha` x the chosen answer's NLL; SimPO's is -log sigmoid(beta x (mean log p(chosen) - mean log p(rejected))
- simpo_gamma), the means per answer token. The pairs arrive tokenized from the data stage (the `preferences`
record kind), laid out for TRL by `reference_free.PairCollator`. TRL takes the model's whole logits of both rows
(no fused head), which the plan counts (`ObjectiveSpec.full_logits`).
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
    from trl.experimental.cpo import CPOConfig, CPOTrainer


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> CPOConfig:
    """Every knob of the run in one place: the shared arguments plus CPO's or SimPO's (`objective.*`)."""
    kwargs = config_kwargs(cfg, plan, run_dir, compute_dtype)
    d = cfg.objective
    kwargs.update(
        loss_type=d.loss_type,
        beta=d.beta,
        cpo_alpha=d.cpo_alpha,
        simpo_gamma=d.target_margin,  # read by the simpo loss only
        label_smoothing=d.label_smoothing,
        # The data stage applied the length limits; TRL reads this only when it generates.
        max_length=cfg.train.seq_len,
        disable_dropout=True,
    )
    return CPOConfig(**kwargs)


class FinetuneCPOTrainer(ReferenceFreeTrainer, CPOTrainer):
    """CPOTrainer on the data stage's tokenized pairs, counting tokens for throughput."""


Trainer = FinetuneCPOTrainer


def trainer_kwargs(cfg: Config, plan: Plan, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    """CPO's own arguments of the trainer: the pair collator, the held-out pairs when there are any."""
    return dict(
        data_collator=PairCollator(pad_token_id=tokenizer.pad_token_id),
        eval_dataset=eval_dataset if eval_dataset is not None and len(eval_dataset) else None,
    )


# TRL's logged CPO metrics (trl/experimental/cpo/cpo_trainer.py), by the names metrics.json gives them.
_LOGGED = {
    "reward_margin": "rewards/margins",  # beta x (log p(chosen) - log p(rejected)), per token for SimPO
    "accuracy": "rewards/accuracies",
    "nll_loss": "nll_loss",
}


def objective_metrics(log_history: list[dict]) -> dict[str, Any]:
    """The reward margin, its accuracy and the NLL over the logged steps (first, last, mean)."""
    return summary(log_history, _LOGGED)
