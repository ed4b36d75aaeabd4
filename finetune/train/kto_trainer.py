"""Kahneman-Tversky optimisation: TRL's `KTOTrainer` with a `KTOConfig` built from the typed config and the plan.

The examples arrive tokenized from the data stage (the `labelled` record kind: TRL's `prompt_ids`,
`completion_ids`, `label`, rendered with the model's chat template, cleaned, limited and ordered there), so TRL's
own tokenizing is skipped (`_prepare_dataset`); what is left of it is TRL's KL pairing, done here the same way:
each micro-batch's completions rotated by one, (x_1, y_n), (x_2, y_1), ..., into `KL_completion_ids`.

What a step runs (`KTOTrainer._compute_loss`), per micro-batch of examples: the policy's forward on the KL
pairs under no_grad, its forward on the examples (the one the backward runs through), then the reference's
forwards on the KL pairs and on the examples under no_grad. The reference: with adapters the model with its
adapter disabled (TRL keeps no second copy of the base; given a PEFT model, a frozen "ref" copy of the adapter
under `init_from`); with full fine-tuning a frozen copy, or both reference log-probabilities precomputed once
before training (`objective.reference`, the plan's choice under `auto`). A micro-batch holds at least two
examples (TRL refuses one: its KL pair would be the example itself).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from trl import KTOConfig, KTOTrainer
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

from finetune.core.config import Config
from finetune.planner import Plan
from finetune.train.base_trainer import RunTrainerMixin, common_kwargs
from finetune.train.callbacks import RunMonitor
from finetune.train.dpo_trainer import precompute_reference

log = logging.getLogger(__name__)


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> KTOConfig:
    """Every knob of the run in one place: the shared arguments plus KTO's (`objective.*`)."""
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    k = cfg.objective
    kwargs.update(
        beta=k.beta,
        loss_type=k.loss_type,
        desirable_weight=k.desirable_weight,
        undesirable_weight=k.undesirable_weight,
        precompute_ref_log_probs=precompute_reference(cfg, plan),
        # The data stage applied the length limit.
        max_length=None,
        pad_to_multiple_of=None,
        # Dropout off in policy and reference, as TRL's default: the implicit reward compares like with like.
        disable_dropout=True,
    )
    return KTOConfig(**kwargs)


def with_kl_pairs(dataset: Any, micro_batch_size: int) -> Any:
    """`KL_completion_ids`: each micro-batch's completions rotated by one, as TRL's `_prepare_dataset` pairs
    them (a batch is `micro_batch_size` consecutive rows: the sampler is sequential)."""

    def rotate(rows: dict) -> dict:
        rows["KL_completion_ids"] = [rows["completion_ids"][-1]] + rows["completion_ids"][:-1]
        return rows

    return dataset.map(rotate, batched=True, batch_size=micro_batch_size)


def weight_advice(
    desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str:
    """What the KTO paper's rule (its eq. 8: desirable_weight x desirable / (undesirable_weight x undesirable)
    within [1, 4/3]) asks of the weights for these counts, or "" when they keep it, as TRL checks them."""
    if not desirable or not undesirable:
        return ""
    ratio = desirable_weight * desirable / (undesirable_weight * undesirable)
    if 1.0 <= round(ratio, 2) <= 1.33:
        return ""
    low = undesirable * undesirable_weight / desirable
    high = desirable * desirable_weight / undesirable
    return (
        f"{desirable} desirable and {undesirable} undesirable examples weighed {desirable_weight:g} and "
        f"{undesirable_weight:g}: set objective.desirable_weight in [{low:.2f}, {1.33 * low:.2f}] or "
        f"objective.undesirable_weight in [{high / 1.33:.2f}, {high:.2f}] (the KTO paper's range)"
    )


class FinetuneKTOTrainer(RunTrainerMixin, KTOTrainer):
    """KTOTrainer on the data stage's tokenized examples, counting tokens for throughput."""

    def __init__(self, *args: Any, monitor: Optional[RunMonitor] = None, **kwargs: Any):
        with warnings.catch_warnings():
            # TRL warns that a PEFT model passed in gets a "ref" copy of its adapter: that is the reference wanted.
            warnings.filterwarnings("ignore", message=r".*ref.*adapter.*")
            super().__init__(*args, **kwargs)
        self._init_run(monitor)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """As prepared by the data stage (rendered, cleaned, limited, tokenized, ordered): the KL pairs added."""
        if dataset_name == "train":
            labels = dataset["label"]
            advice = weight_advice(
                sum(labels), len(labels) - sum(labels), self.desirable_weight, self.undesirable_weight
            )
            if advice:
                log.warning("KTO: %s", advice)
        return with_kl_pairs(dataset, args.per_device_train_batch_size) if self.calculate_KL else dataset

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and self.monitor is not None and "attention_mask" in inputs:
            self.monitor.add_tokens(int(inputs["attention_mask"].sum()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


Trainer = FinetuneKTOTrainer


def trainer_kwargs(cfg: Config, plan: Plan, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    """KTO's own arguments of the trainer: TRL's unpaired collator, the held-out examples when there are any
    (their `messages` column, the evaluation's, left out)."""
    if eval_dataset is not None and len(eval_dataset):
        eval_dataset = eval_dataset.remove_columns(
            [c for c in eval_dataset.column_names if c not in ("prompt_ids", "completion_ids", "label")]
        )
    else:
        eval_dataset = None
    return dict(
        data_collator=DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id),
        eval_dataset=eval_dataset,
    )


# TRL's logged keys summarised into metrics.json (train.kto): first and last logged value, and the mean.
_LOGGED = {
    "reward_desirable": "rewards/chosen",
    "reward_undesirable": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "kl": "kl",
}


def objective_metrics(log_history: list[dict]) -> dict[str, Any]:
    """The implicit rewards of the desirable and undesirable examples, their margin and the KL estimate, as TRL
    logged them in training: first, last and mean over the logged steps, so a run shows whether they parted."""
    logged = [h for h in log_history if "kl" in h and "loss" in h]
    out: dict[str, Any] = {"logged_steps": len(logged)}
    for name, key in _LOGGED.items():
        values = [float(h[key]) for h in logged if key in h]
        if values:
            out[name] = {"first": values[0], "last": values[-1], "mean": sum(values) / len(values)}
    return out
