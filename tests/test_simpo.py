"""SimPO and CPO as objectives (TRL's experimental CPOTrainer, `loss_type="simpo"` and `"sigmoid"`): their
settings, TRL's config built from them, the plan with no reference model, the margin scores with beta and
gamma, and SimPO training on the CPU with those scores for base and trained."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import evaluate, plan_for, planned, prepare_run, tiny_cfg, write_engine

from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES
from finetune.evaluation.odds_scores import MarginScorer


def test_simpo_and_cpo_compose_with_their_own_settings():
    cfg = tiny_cfg("objective=simpo", "objective.simpo_gamma=1.0", "objective.cpo_alpha=0.5")
    s = cfg.objective
    assert s.spec is OBJECTIVES["simpo"] and (s.beta, s.simpo_gamma, s.cpo_alpha) == (2.0, 1.0, 0.5)
    assert s.loss_type == "simpo" and s.length_normalised and s.target_margin == 1.0
    cpo = tiny_cfg("objective=cpo", "objective.loss_type=ipo").objective
    assert cpo.spec.trainer == s.spec.trainer  # one trainer module, two descriptions
    assert cpo.length_normalised and cpo.target_margin == 0.0
    assert not tiny_cfg("objective=cpo").objective.length_normalised
    for name in ("simpo", "cpo"):
        assert OBJECTIVES[name].reference == "none" and OBJECTIVES[name].full_logits


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("objective=simpo objective.simpo_gamma=-1", "objective.simpo_gamma=-1.0 must be >= 0"),
        ("objective=simpo objective.label_smoothing=0.5", "objective.label_smoothing=0.5 must be below 0.5"),
        ("objective=simpo objective.loss_type=ipo", "objective.loss_type: unknown key"),
        (
            "objective=cpo objective.loss_type=simpo",
            "objective.loss_type='simpo' is not one of sigmoid, hinge, ipo",
        ),
        ("objective=cpo objective.simpo_gamma=1", "objective.simpo_gamma: unknown key"),
    ],
)
def test_bad_simpo_and_cpo_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        tiny_cfg(*overrides.split())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_trls_cpo_config_carries_the_settings(tmp_path: Path):
    from helpers import planned_run_dir

    from finetune.modeling.dtypes import training_dtype
    from finetune.train import cpo_trainer

    overrides = ("+recipe=tiny_simpo", "objective.simpo_gamma=0.8", "objective.cpo_alpha=0.1")
    cfg, plan, run_dir = planned_run_dir(tmp_path, *overrides)
    write_engine(cfg, plan, run_dir)
    args = cpo_trainer.build_config(cfg, plan, run_dir, training_dtype(cfg))
    assert (args.loss_type, args.beta, args.simpo_gamma, args.cpo_alpha) == ("simpo", 2.0, 0.8, 0.1)
    assert args.disable_dropout and args.per_device_train_batch_size == plan.strategy.micro_batch_size


def test_simpo_plan_is_orpos_no_reference_and_the_whole_logits():
    fixed = ("+recipe=llama8b_lora", "train.micro_batch_size=2", "train.activation_checkpointing=true")
    _, simpo = planned(*fixed, "objective=simpo")
    _, orpo = planned(*fixed, "objective=orpo")
    assert simpo.gpu_memory == orpo.gpu_memory and simpo.strategy == orpo.strategy
    cfg, plan = planned("+recipe=llama8b_simpo")
    assert cfg.objective.name == "simpo" and plan.fits


def test_margin_scores_length_normalise_and_count_the_target_margin():
    scorer = MarginScorer.__new__(MarginScorer)
    scorer.lengths = [(2, 4), (1, 1), (3, 3)]
    sums = [[-2.0, -8.0], [-3.0, -1.0], [-3.0, -3.6]]
    scorer.settings = tiny_cfg("objective=simpo", "objective.beta=2", "objective.simpo_gamma=0.5").objective
    s = scorer.scores(sums)  # means: (-1, -2), (-3, -1), (-1, -1.2); margins 2, -4, 0.4
    assert s["margin_accuracy"] == pytest.approx(2 / 3) and s["pairs"] == 3
    assert s["reward_margin"] == pytest.approx((2 - 4 + 0.4) / 3)
    assert s["margin_met"] == pytest.approx(1 / 3)  # only the first clears gamma = 0.5
    scorer.settings = tiny_cfg("objective=cpo", "objective.beta=0.1").objective
    s = scorer.scores(sums)  # summed: margins 0.6, -0.2, 0.06
    assert s["reward_margin"] == pytest.approx((0.6 - 0.2 + 0.06) / 3)
    assert s["margin_met"] == s["margin_accuracy"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_simpo_trains_the_tiny_model_and_scores_base_and_trained(tmp_path, tiny_cache):
    from finetune.data import stage as data_stage
    from finetune.pipeline.stages import resolve
    from finetune.train import stage

    cfg = tiny_cfg(
        "objective=simpo",
        "train.seq_len=64",
        "train.max_steps=4",
        "train.logging_steps=1",
        "train.save_steps=1000",
        "train.warmup_ratio=0.0",
        "method.learning_rate=3e-3",
        f"data.cache_dir={tmp_path / 'cache'}",
        run_dir=tmp_path / "run",
    )
    run = prepare_run(cfg)
    train, evals = data_stage.load_prepared(run)
    cfg = resolve(cfg)
    plan = plan_for(cfg, micro_batch_size=4, grad_accum_steps=1)
    write_engine(cfg, plan, run)
    held_out = evals.select(range(8))
    metrics = stage.run(cfg, run, plan, datasets=(train.select(range(8)), held_out))
    t = metrics["train"]
    assert t["steps"] == 4 and math.isfinite(t["final_loss"]) and t["engine"]["world_size"] == 1
    simpo = t["simpo"]
    assert simpo["logged_steps"] == 4 and simpo["nll_loss"]["last"] == 0.0  # cpo_alpha 0: SimPO as published
    # the same 8 pairs every second step: the margin on them grows
    assert simpo["reward_margin"]["last"] > simpo["reward_margin"]["first"]
    scores = evaluate(cfg, run, held_out, 2)
    base, trained = scores["base"], scores["trained"]
    assert base["pairs"] == trained["pairs"] == 8
    for s in (base, trained):
        assert 0.0 <= s["margin_met"] <= s["margin_accuracy"] <= 1.0 and math.isfinite(s["reward_margin"])
