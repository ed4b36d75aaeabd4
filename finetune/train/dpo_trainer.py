"""Preference fine-tuning: TRL's `DPOTrainer` with a `DPOConfig` built from the typed config and the plan.

The pairs arrive tokenized from the data stage (`prepare.preferences`: TRL's `prompt_ids`, `chosen_ids`,
`rejected_ids`, rendered with the model's chat template, cleaned and limited there), so TRL's own
tokenizing is skipped (`_prepare_dataset`) and its `DataCollatorForPreference` batches them: every
micro-batch carries each pair's chosen and rejected sequence (twice the sequences of SFT).

The reference: with adapters, the model with its adapter disabled (TRL keeps no second copy of the base;
given a PEFT model it adds a frozen "ref" copy of the adapter, which is the starting adapter under
`init_from`); with full fine-tuning, a frozen copy of the starting model prepared like the policy (sharded
under ZeRO-3/FSDP2), or log-probabilities precomputed once before training (`dpo.reference`, the plan's
choice under `auto`). The log-probabilities come from TRL's fused LM head (`add_fused_lm_head`), which
never builds the full logits; the project's chunked loss (an SFT loss) does not run here.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from transformers.trainer_utils import IntervalStrategy
from trl import DPOConfig, DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from finetune.core.config import Config
from finetune.planner import Plan
from finetune.train.base_trainer import RunTrainerMixin, common_kwargs, finish_trainer, run_callbacks
from finetune.train.callbacks import RunMonitor


def precompute_reference(cfg: Config, plan: Plan) -> bool:
    """Full fine-tuning's reference as log-probabilities computed once before training, rather than a frozen
    copy beside the policy: the plan's choice (`dpo.reference`, or the planner's under `auto`). Adapters never
    need it (the reference is the base with the adapter disabled)."""
    return cfg.method.spec.trains_base_weights and plan.strategy.precompute_reference


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> DPOConfig:
    """Every knob of the run in one place: the shared arguments plus DPO's (`dpo.*`)."""
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    d = cfg.dpo
    kwargs.update(
        beta=d.beta,
        loss_type=[d.loss_type],
        label_smoothing=d.label_smoothing,
        precompute_ref_log_probs=precompute_reference(cfg, plan),
        # The data stage applied the length limits (a pair whose longer side cannot fit is dropped or truncated).
        max_length=None,
        padding_free=False,
        # Dropout off in policy and reference, as TRL's default: the implicit reward compares like with like.
        disable_dropout=True,
    )
    return DPOConfig(**kwargs)


class FinetuneDPOTrainer(RunTrainerMixin, DPOTrainer):
    """DPOTrainer on the data stage's tokenized pairs, counting tokens for throughput."""

    def __init__(self, *args: Any, monitor: Optional[RunMonitor] = None, **kwargs: Any):
        with warnings.catch_warnings():
            # TRL warns that a PEFT model passed in gets a "ref" copy of its adapter: that is the reference wanted.
            warnings.filterwarnings("ignore", message=r".*ref.*adapter.*")
            super().__init__(*args, **kwargs)
        self._init_run(monitor)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """As prepared by the data stage (rendered, cleaned, limited, tokenized): nothing left to do."""
        return dataset

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and self.monitor is not None and "attention_mask" in inputs:
            self.monitor.add_tokens(int(inputs["attention_mask"].sum()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def build_trainer(
    cfg: Config,
    plan: Plan,
    run_dir: Path,
    model: Any,
    tokenizer: Any,
    train_dataset: Any,
    eval_dataset: Any,
    compute_dtype: torch.dtype,
    callbacks: list[Any],
    monitor: Optional[RunMonitor] = None,
    args: Optional[DPOConfig] = None,
) -> FinetuneDPOTrainer:
    """The DPO trainer for `model`; `args` when built before loading the model (ZeRO-3: see load_for_training)."""
    args = args or build_config(cfg, plan, run_dir, compute_dtype)
    held_out = eval_dataset if eval_dataset is not None and len(eval_dataset) else None
    if held_out is None:  # data.eval_fraction=0, or no pair left to hold out: no evaluation during training
        args.eval_strategy = IntervalStrategy.NO
    trainer = FinetuneDPOTrainer(
        model=model,
        args=args,
        data_collator=DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id),
        train_dataset=train_dataset,
        eval_dataset=held_out,
        processing_class=tokenizer,
        callbacks=run_callbacks(cfg, run_dir, args, callbacks),
        monitor=monitor,
    )
    return finish_trainer(trainer, cfg)
