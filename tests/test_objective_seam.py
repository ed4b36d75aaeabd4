"""A new objective is its own files: registered here with no edit elsewhere, it composes, plans, prepares its
records and trains the tiny model on the CPU, its evaluation scores read with its own settings.

This module is that objective's files in one: its description (`SPEC`), its settings dataclass
(`RPOObjective`) and its trainer module (`build_config`, `Trainer`, `trainer_kwargs`, `objective_metrics`),
built on TRL's DPOTrainer with the negative log-likelihood of the chosen answer added to the DPO loss (RPO:
TRL's `loss_type=["sigmoid", "sft"]`). Registered in the objective table only, with no YAML, it is chosen by
its schema alone (`objective=rpo`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
from helpers import evaluate, plan_for, planned, prepare_run, tiny_cfg, write_engine
from trl import DPOConfig, DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from finetune.core.config.checks import check_positive
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.objectives import OBJECTIVES, ObjectiveSpec
from finetune.train.base_trainer import RunTrainerMixin, common_kwargs

# ---------------------------------------------------------------- the objective's files


SPEC = ObjectiveSpec(
    "rpo",
    "DPO plus the chosen answer's negative log-likelihood",
    record_kind="preferences",
    settings=f"{__name__}:RPOObjective",
    trainer=__name__,
    trl_trainer="DPOTrainer",
    trl_config="DPOConfig",
    sequences_per_example=2,
    batch_unit="pairs",
    reference="always",
    scores="preference",
)


@dataclass
class RPOObjective(ObjectiveConfig):
    """`objective=rpo objective.nll_weight=0.5`."""

    name: str = "rpo"
    beta: float = 0.1
    nll_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("objective.nll_weight", self.nll_weight)


# The TRL configs the trainers were built with, for the checks below.
BUILT: list[DPOConfig] = []


def build_config(cfg: Any, plan: Any, run_dir: Path, compute_dtype: Any) -> DPOConfig:
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    kwargs.update(
        beta=cfg.objective.beta,
        loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, cfg.objective.nll_weight],
        max_length=None,
        padding_free=False,
        disable_dropout=True,
    )
    return DPOConfig(**kwargs)


class Trainer(RunTrainerMixin, DPOTrainer):
    def __init__(self, *args: Any, monitor: Optional[Any] = None, **kwargs: Any):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*ref.*adapter.*")
            super().__init__(*args, **kwargs)
        self._init_run(monitor)
        BUILT.append(self.args)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # tokenized by the data stage's `preferences` record kind


def trainer_kwargs(cfg: Any, plan: Any, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    return dict(data_collator=collator, eval_dataset=eval_dataset)


def objective_metrics(log_history: list[dict]) -> dict[str, Any]:
    logged = [h["rewards/accuracies"] for h in log_history if "rewards/accuracies" in h]
    return {"logged_steps": len(logged)}


# ---------------------------------------------------------------- the checks


@pytest.fixture
def rpo(monkeypatch):
    """The objective in the table, for this test only (the one line a new objective adds there)."""
    monkeypatch.setitem(OBJECTIVES, "rpo", SPEC)
    BUILT.clear()
    return SPEC


def test_a_registered_objective_composes_with_its_own_settings(rpo):
    cfg = tiny_cfg("objective=rpo", "objective.nll_weight=0.5")
    assert cfg.objective == RPOObjective(nll_weight=0.5) and cfg.objective.spec is rpo
    with pytest.raises(Exception, match=r"objective.nll_weight=0.0 must be > 0"):
        tiny_cfg("objective=rpo", "objective.nll_weight=0")
    with pytest.raises(
        Exception, match=r"objective.loss_type: unknown key; valid keys: beta, name, nll_weight"
    ):
        tiny_cfg("objective=rpo", "objective.loss_type=ipo")


def test_a_registered_objective_is_planned_as_its_description_says(rpo):
    """Two sequences a pair and a reference: the same plan as DPO's, read from the description alone."""
    fixed = ("+recipe=llama8b_lora", "train.micro_batch_size=2", "train.activation_checkpointing=true")
    _, mine = planned(*fixed, "objective=rpo")
    _, dpo = planned(*fixed, "objective=dpo")
    assert mine.gpu_memory == dpo.gpu_memory and mine.strategy == dpo.strategy


@pytest.mark.slow
def test_a_registered_objective_prepares_and_trains_the_tiny_model(rpo, tmp_path, tiny_cache):
    from finetune.data import stage as data_stage
    from finetune.pipeline.stages import resolve
    from finetune.train import stage

    cfg = tiny_cfg(
        "objective=rpo",
        "objective.nll_weight=0.5",
        "train.seq_len=64",
        "train.max_steps=3",
        "train.save_steps=1000",
        "train.warmup_ratio=0.0",
        "method.learning_rate=1e-3",
        f"data.cache_dir={tmp_path / 'cache'}",
        run_dir=tmp_path / "run",
    )
    run = prepare_run(cfg)
    train, evals = data_stage.load_prepared(run)
    assert {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(train.column_names)  # its record kind's rows

    cfg = resolve(cfg)
    plan = plan_for(cfg, micro_batch_size=2, grad_accum_steps=1)
    write_engine(cfg, plan, run)
    held_out = evals.select(range(4))
    metrics = stage.run(cfg, run, plan, datasets=(train.select(range(6)), held_out))
    scores = evaluate(cfg, run, held_out, 2)

    (args,) = BUILT
    assert args.loss_type == ["sigmoid", "sft"] and args.loss_weights == [1.0, 0.5] and args.beta == 0.1
    assert metrics["train"]["steps"] == 3 and math.isfinite(metrics["train"]["final_loss"])
    assert metrics["train"]["rpo"] == {"logged_steps": 3}  # its own summary of what TRL logged
    trained = scores["trained"]
    assert 0.0 <= trained["preference_accuracy"] <= 1.0 and math.isfinite(trained["reward_margin"])
