"""Reward modelling: TRL's `RewardTrainer` with a `RewardConfig` built from the typed config and the plan.

The model is the base as a sequence classifier with one label (`ObjectiveSpec.head="score"`: loaded so by
finetune/modeling/loading.py, the score head new from the seed, trained in full beside LoRA's adapters), so no
vocabulary logits are ever made. The pairs arrive tokenized from the data stage (the `preferences` record kind:
TRL's `prompt_ids`, `chosen_ids`, `rejected_ids`, the answers apart from the prompt as DPO takes them); the
collator puts each pair's prompt + chosen and prompt + rejected sequence into the batch, which is the
tokenized form TRL's `RewardTrainer` takes (`chosen_ids` / `rejected_ids`: whole sequences). The loss is TRL's:
-log sigmoid(score_chosen - score_rejected), with `objective.center_rewards_coefficient` x the mean squared score
when set. No reference model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from trl import RewardConfig, RewardTrainer
from trl.trainer.reward_trainer import DataCollatorForPreference

from finetune.core.config import Config
from finetune.modeling.reward_model import pair_sequences
from finetune.planner import Plan
from finetune.train.base_trainer import RunTrainerMixin, common_kwargs
from finetune.train.callbacks import RunMonitor


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> RewardConfig:
    """The shared arguments plus reward modelling's (`objective.*`)."""
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    kwargs.update(
        center_rewards_coefficient=cfg.objective.center_rewards_coefficient,
        # The data stage applied the length limits (a pair whose longer side cannot fit is dropped or truncated).
        max_length=None,
        # Dropout off, as TRL's default: the two sequences of a pair are scored alike.
        disable_dropout=True,
    )
    return RewardConfig(**kwargs)


@dataclass
class PairCollator(DataCollatorForPreference):
    """TRL's reward collator on the data stage's pairs: each answer after its prompt (the rows' `prompt_ids`),
    the chosen sequences first, then the rejected ones, right-padded."""

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return super().torch_call(pair_sequences(examples))


class FinetuneRewardTrainer(RunTrainerMixin, RewardTrainer):
    """RewardTrainer on the data stage's tokenized pairs, counting tokens for throughput."""

    def __init__(self, *args: Any, monitor: Optional[RunMonitor] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_run(monitor)
        for name, module in self.model.named_modules():
            # the head itself, or PEFT's trainable copy of it and the frozen original (score.modules_to_save...)
            if "score" in name.split(".") and isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(_in_head_dtype)


def _in_head_dtype(module: Any, args: tuple) -> tuple:
    """The hidden states in the score head's dtype: QLoRA's trainable head is kept in the adapters' dtype
    (`method.adapter_dtype`, bf16), while the frozen base may compute in fp32 (QLoRA on the CPU)."""
    return tuple(
        a.to(module.weight.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args
    )

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """As prepared by the data stage (rendered, cleaned, limited, tokenized): the collator joins each side."""
        return dataset

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and self.monitor is not None:
            self.monitor.add_tokens(int(inputs["attention_mask"].sum()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


Trainer = FinetuneRewardTrainer


def trainer_kwargs(cfg: Config, plan: Plan, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    """Reward modelling's own arguments of the trainer: the pair collator, the held-out pairs when there are any."""
    return dict(
        data_collator=PairCollator(pad_token_id=tokenizer.pad_token_id),
        eval_dataset=eval_dataset if eval_dataset is not None and len(eval_dataset) else None,
    )


# TRL's logged keys summarised into metrics.json (train.reward): first and last logged value, and the mean.
_LOGGED = {
    "accuracy": "accuracy",
    "margin": "margin",
    "eval_accuracy": "eval_accuracy",
    "eval_margin": "eval_margin",
}


def objective_metrics(log_history: list[dict]) -> dict[str, Any]:
    """The training pairs' accuracy (chosen scored above rejected) and mean margin as TRL logged them, and the
    held-out ones at each evaluation during training: first, last and mean, so a run shows whether they rose."""
    out: dict[str, Any] = {}
    for name, key in _LOGGED.items():
        values = [float(h[key]) for h in log_history if key in h]
        if values:
            out[name] = {"first": values[0], "last": values[-1], "mean": sum(values) / len(values)}
    return out
