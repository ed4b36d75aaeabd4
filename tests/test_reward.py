"""Reward modelling as an objective: the axis (config group, spec table), the pairs as a reward model's
sequences, the model loaded as a one-label sequence classifier in every stage, training with TRL's
RewardTrainer on the CPU (one process), and the evaluation's pair accuracy and margin, base against trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import prepare_run, tiny_cfg

from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES

REWARD_RUN = (
    "+recipe=tiny_reward",
    "method=lora",
    "method.lora_dropout=0",
    "train.batch_size=8",
    "train.max_steps=4",
    "train.save_steps=1000",
    "train.eval_steps=1000",
    "train.warmup_ratio=0.0",
    "train.report_to=[]",
)


def test_objective_composes_and_describes_a_score_head():
    cfg = tiny_cfg("objective=reward", "objective.center_rewards_coefficient=0.01")
    spec = cfg.objective.spec
    assert spec is OBJECTIVES["reward"] and cfg.objective.center_rewards_coefficient == 0.01
    assert (spec.record_kind, spec.trl_trainer, spec.trl_config) == (
        "preferences",
        "RewardTrainer",
        "RewardConfig",
    )
    assert (spec.head, spec.generates_text, spec.reference, spec.sequences_per_example) == (
        "score",
        False,
        "none",
        2,
    )
    assert spec.scorer_class().__module__ == "finetune.evaluation.reward_model_scores"
    assert set(spec.eval_metrics) == {"pair_accuracy", "score_margin", "score_chosen", "score_rejected"}
    assert "reward model" in spec.export


@pytest.mark.parametrize(
    "override, message",
    [
        ("objective.center_rewards_coefficient=-1", "objective.center_rewards_coefficient=-1.0 must be > 0"),
        ("objective.beta=0.1", "objective.beta: unknown key"),
    ],
)
def test_bad_reward_settings_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_cfg("objective=reward", override)


def test_the_collator_scores_prompt_and_answer_as_one_sequence():
    from finetune.train.reward_trainer import PairCollator

    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 8, 9], "rejected_ids": [10]},
        {"prompt_ids": [5], "chosen_ids": [11], "rejected_ids": [12, 13]},
    ]
    batch = PairCollator(pad_token_id=0)(rows)
    # the chosen sequences first, then the rejected ones, each prompt + answer, right-padded
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 8, 9],
        [5, 11, 0, 0, 0],
        [5, 6, 10, 0, 0],
        [5, 12, 13, 0, 0],
    ]
    assert batch["attention_mask"].sum(dim=1).tolist() == [5, 2, 3, 3]


def test_reward_scores_count_strict_wins_and_the_mean_margin():
    from finetune.evaluation.reward_model_scores import scores

    got = scores([[1.0, 0.0], [0.5, 0.5], [-1.0, 2.0], [3.0, 1.0]])
    assert got["pair_accuracy"] == 0.5  # the tie does not count as ranked
    assert got["score_margin"] == pytest.approx((1.0 + 0.0 - 3.0 + 2.0) / 4)
    assert (got["score_chosen"], got["score_rejected"], got["pairs"]) == (0.875, 0.875, 4)
    assert scores([]) == {}


def test_the_base_loads_as_a_classifier_with_the_head_training_starts_from(tiny_cache):
    import torch

    from finetune.modeling.loading import load_for_training
    from finetune.modeling.variants import load_variant

    cfg = tiny_cfg("objective=reward", "method=full")
    trained_start, _ = load_for_training(cfg)
    base = load_variant(cfg, Path("/nonexistent"), "base")
    assert type(base).__name__ == "LlamaForSequenceClassification" and base.config.num_labels == 1
    assert not hasattr(base, "lm_head") and base.config.pad_token_id is not None
    assert torch.equal(base.score.weight, trained_start.score.weight)
    other_seed = load_variant(tiny_cfg("objective=reward", "train.seed=1"), Path("/nonexistent"), "base")
    assert not torch.equal(other_seed.score.weight, base.score.weight)


@pytest.mark.slow
def test_training_and_evaluation_rank_the_held_out_pairs(tiny_cache, tmp_path):
    """Four LoRA steps through the training stage, then the eval stage: the score head trained in full beside the
    adapters and saved with them, and each model's pair accuracy and margin recomputed from its scores."""
    from safetensors import safe_open

    from finetune.data.stage import load_prepared
    from finetune.evaluation import stage as eval_stage
    from finetune.modeling.reward_model import pair_scores
    from finetune.modeling.variants import load_variant
    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    cfg = resolve(tiny_cfg(*REWARD_RUN, "method.learning_rate=3e-3", run_dir=tmp_path / "run"))
    run = prepare_run(cfg)
    plan = plan_stage(cfg, run, quiet=True)
    metrics = stage.run(cfg, run, plan)
    train = metrics["train"]
    assert train["steps"] == 4 and train["engine"]["world_size"] == 1
    assert set(train["reward"]) >= {"accuracy", "margin"}
    with safe_open(str(run / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        names = f.keys()
        score = [k for k in names if "score" in k]
        assert score and f.get_tensor(score[0]).shape == (1, cfg.model.hidden_size)
    evaluated = eval_stage.run(cfg, run)
    assert set(evaluated) >= {"base", "trained"} and evaluated["regression"] == {}
    _, evals = load_prepared(run)
    for v in ("base", "trained"):
        got = evaluated[v]
        assert (
            "loss" not in got and "generated" not in got
        )  # a score head neither generates nor has an LM loss
        model = load_variant(cfg, run, v)
        pairs = pair_scores(model, evals, 0)
        assert got["pairs"] == len(evals) == len(pairs)
        assert got["pair_accuracy"] == sum(c > r for c, r in pairs) / len(pairs)
        assert got["score_margin"] == pytest.approx(sum(c - r for c, r in pairs) / len(pairs), abs=1e-5)
    assert evaluated["trained"]["score_margin"] != evaluated["base"]["score_margin"]
    report = (run / "eval" / "report.md").read_text()
    assert "pair_accuracy" in report
    assert json.loads((run / "metrics.json").read_text())["eval"]["trained"] == evaluated["trained"]


@pytest.mark.slow
def test_bf16_on_the_cpu_trains_the_score_head_under_autocast(tiny_cache, tmp_path):
    """bf16 on the CPU (emulated) runs as on a GPU: a bf16 base under accelerate's autocast, the adapters and the
    trained score head in fp32 (PEFT's default), finite losses."""
    import math

    from helpers import last_losses

    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    cfg = resolve(
        tiny_cfg(*REWARD_RUN, "train.max_steps=2", "method.precision=bf16", run_dir=tmp_path / "run")
    )
    run = prepare_run(cfg)
    train = stage.run(cfg, run, plan_stage(cfg, run, quiet=True))["train"]
    assert train["precision"] == "bf16" and train["engine"]["mixed_precision"] == "bf16"
    assert train["engine"]["parameter_dtypes"] == ["bfloat16", "float32"]
    steps = last_losses(run)
    assert len(steps) == 2 and all(math.isfinite(x) for x in steps)


@pytest.mark.slow
def test_qlora_trains_its_score_head_beside_the_4_bit_base(tiny_cache, tmp_path):
    """QLoRA: the 4-bit base computes in fp32 on the CPU while the trained head is kept in the adapters' bf16;
    the head's input is cast to its dtype, and the head is saved with the adapter."""
    import math

    from helpers import last_losses
    from safetensors import safe_open

    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    cfg = resolve(tiny_cfg(*REWARD_RUN, "method=qlora", "train.max_steps=2", run_dir=tmp_path / "run"))
    run = prepare_run(cfg)
    train = stage.run(cfg, run, plan_stage(cfg, run, quiet=True))["train"]
    assert train["method"] == "qlora" and all(math.isfinite(x) for x in last_losses(run))
    with safe_open(str(run / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        names = f.keys()
        head = [f.get_tensor(k) for k in names if "score" in k]
    assert [str(t.dtype) for t in head] == ["torch.bfloat16"]
