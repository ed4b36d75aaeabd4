"""objective=rloo on the tiny model on the CPU: its settings (GRPO's, with RLOO's loss and baseline), their
mapping onto TRL's RLOOConfig, the training stage on the data stage's prompts, and its bad inputs.

RLOO reuses GRPO's record kind (`prompts`), rewards and rollout wiring; what differs is TRL's trainer: a
leave-one-out baseline, the KL to the reference as a penalty on the reward, one clipped ratio per sequence.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest
from helpers import prepare_run, run_cli, tiny_cfg

from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES
from finetune.core.rewards import resolve

RLOO_RUN = (
    "objective=rloo",
    "train.batch_size=4",
    "objective.num_generations=4",
    "objective.max_completion_length=6",
    "method.precision=bf16",
)


def test_rloo_is_grpo_settings_less_the_loss_type_and_its_spec_is_grpo_shaped() -> None:
    from finetune.core.config.grpo import GRPOObjective
    from finetune.core.config.rloo import RLOOObjective

    cfg = tiny_cfg(*RLOO_RUN)
    spec = cfg.objective.spec
    assert isinstance(cfg.objective, RLOOObjective) and isinstance(cfg.objective, GRPOObjective)
    assert (spec.record_kind, spec.trl_trainer, spec.trl_config) == ("prompts", "RLOOTrainer", "RLOOConfig")
    assert spec.generates and spec.reference == "when_kl" and spec.sequences_setting == "num_generations"
    assert (
        spec.eval_metrics == OBJECTIVES["grpo"].eval_metrics
    )  # mean reward, pass rate, a learned reward's score
    # every GRPO setting is kept; RLOO adds its own
    grpo, rloo = {f.name for f in fields(GRPOObjective)}, {f.name for f in fields(RLOOObjective)}
    assert grpo < rloo and rloo - grpo == {"epsilon", "normalize_advantages", "reward_clip_range"}
    # TRL's RLOO defaults: a KL penalty of 0.05, the one sequence loss
    assert (cfg.objective.beta, cfg.objective.loss_type) == (0.05, "sequence")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("objective.loss_type=dapo", "objective.loss_type='dapo' must be one of sequence"),
        ("objective.num_generations=1", "objective.num_generations=1: RLOO's leave-one-out baseline needs"),
        ("objective.reward_clip_range=[1,0]", "objective.reward_clip_range=[1.0, 0.0] must be [min, max]"),
        ("objective.epsilon=1.5", "objective.epsilon=1.5 must be between 0 and 1"),
        ("objective.beta=-1", "objective.beta=-1.0 must be >= 0"),
        ("train.batch_size=6", "train.batch_size=6 must be a multiple of objective.num_generations=4"),
    ],
)
def test_bad_settings_are_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_cfg(*RLOO_RUN, override)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_settings_reach_rloo_config_and_grpo_ones_stay_grpo_s(tmp_path: Path) -> None:
    from trl import RLOOConfig

    from finetune.train.rloo_trainer import build_rloo_config

    cfg = tiny_cfg(
        *RLOO_RUN,
        "objective.beta=0.1",
        "objective.epsilon=0.3",
        "objective.normalize_advantages=true",
        "objective.reward_clip_range=[-1,2]",
        "objective.mask_truncated_completions=true",
        "objective.rewards=[exact_match,contains]",
        "objective.reward_weights=[1.0,0.5]",
    )
    args = build_rloo_config(
        cfg.objective, resolve(cfg.objective.rewards, cfg.objective.reward_weights), tmp_path,
        generation="transformers", use_cpu=True, per_device_train_batch_size=4,
    )  # fmt: skip
    assert isinstance(args, RLOOConfig)
    assert (args.num_generations, args.max_completion_length, args.temperature) == (4, 6, 1.0)
    assert (args.beta, args.epsilon, args.normalize_advantages) == (0.1, 0.3, True)
    assert args.reward_clip_range == (-1.0, 2.0) and args.mask_truncated_completions is True
    assert args.reward_weights == [1.0, 0.5] and args.use_vllm is False
    assert not hasattr(args, "loss_type")  # RLOOConfig has none: RLOO's loss has one form


def test_training_stage_runs_rloo_and_records_the_rewards(tiny_cache: Path, tmp_path: Path) -> None:
    from finetune.pipeline.stages import plan_stage
    from finetune.pipeline.stages import resolve as resolve_cfg
    from finetune.train import stage

    cfg = resolve_cfg(
        tiny_cfg(
            *RLOO_RUN,
            "train.max_steps=3",
            "train.logging_steps=1",
            r"objective.rewards=[exact_match,'format:\w+']",
            "objective.reward_weights=[1.0,0.5]",
            run_dir=tmp_path / "run",
        )
    )
    run = prepare_run(cfg)
    plan = plan_stage(cfg, run, quiet=True)
    rollout = json.loads((run / "rollout.json").read_text())
    assert rollout["mode"] == "transformers" and rollout["fits"] is True
    metrics = stage.run(cfg, run, plan)
    rloo = metrics["train"]["rloo"]
    assert metrics["train"]["steps"] == 3 and rloo["logged_steps"] == 3
    assert set(rloo["rewards"]) == {"exact_match", r"format:\w+"}
    # TRL's logged reward is the weighted sum of the per-reward means (the KL penalty is not in it)
    for which in ("first", "last"):
        expected = rloo["rewards"]["exact_match"][which] + 0.5 * rloo["rewards"][r"format:\w+"][which]
        assert rloo["reward"][which] == pytest.approx(expected, abs=1e-5)
    # beta = 0.05: the reference (the adapter as it started) ran, and its KL was logged
    assert "kl" in rloo and 0 < rloo["completion_mean_length"]["mean"] <= 6
    assert metrics["train"]["precision"] == "bf16"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run / "metrics.json").read_text())["train"]["rloo"] == rloo
    # the evaluation scores the held-out prompts with the same rewards, base and trained
    from finetune.evaluation import stage as eval_stage

    evaluated = eval_stage.run(replace(cfg, eval=replace(cfg.eval, num_samples=4, regression=False)), run)
    for v in ("base", "trained"):
        assert evaluated[v]["pass_rate"] <= evaluated[v]["exact_match"] <= evaluated[v]["mean_reward"]
        assert evaluated[v]["mean_reward"] <= evaluated[v]["exact_match"] + 0.5


def test_a_bad_reward_on_the_command_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = run_cli(
        *RLOO_RUN, "objective.rewards=[no_such_reward]", f"run_dir={tmp_path / 'run'}", "mode=plan"
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "objective.rewards" in lines[0]
