"""A learned reward for GRPO: `objective.reward_model` names a reward model (a reward-model run directory or its
exported folder) that scores each completion beside, or instead of, the rewards; the plan counts it as a
companion; the evaluation's `rewards` scores add its mean score; what is not a reward model is one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from helpers import prepare_run, reward_model_folder, run_cli, tiny_cfg

from finetune.core.config.grpo import GRPOObjective
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES, Companion

GRPO_RUN = (
    "objective=grpo",
    "train.batch_size=4",
    "objective.num_generations=4",
    "objective.max_completion_length=6",
    "method.precision=bf16",
)


def test_a_reward_model_is_a_companion_of_the_plan(tiny_cache, tiny_model_cfg, tmp_path):
    folder = reward_model_folder(tmp_path, tiny_model_cfg)
    grpo = OBJECTIVES["grpo"]
    assert grpo.companions_of(GRPOObjective()) == ()
    settings = GRPOObjective(reward_model=str(folder), reward_model_weight=0.5)
    assert grpo.companions_of(settings) == (Companion("reward_model", str(folder), head="score"),)
    # instead of the rewards: none named, the reward model alone
    assert GRPOObjective(rewards=[], reward_model=str(folder)).rewards == []


@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_the_plan_counts_the_reward_model_beside_the_policy(objective, tiny_cache, tiny_model_cfg, tmp_path):
    """GRPO's and RLOO's learned reward is a planned term of its own: the frozen classifier's weights and forward."""
    from finetune.pipeline.stages import config_plan, resolve

    folder = reward_model_folder(tmp_path, tiny_model_cfg)
    run = [a.replace("objective=grpo", f"objective={objective}") for a in GRPO_RUN]
    without = config_plan(resolve(tiny_cfg(*run)))
    cfg = resolve(tiny_cfg(*run, f"objective.reward_model={folder}"))
    planned = config_plan(cfg)
    terms = dict(planned.gpu_memory.terms())
    assert "companion:reward_model" not in dict(without.gpu_memory.terms())
    assert terms["companion:reward_model"] > 0
    assert planned.gpu_memory.total == pytest.approx(sum(terms.values()))


def test_grpo_ranks_by_the_rewards_and_the_reward_model_weighted(tiny_cache, tiny_model_cfg, tmp_path):
    from finetune.modeling.models import load_tokenizer
    from finetune.pipeline.stages import resolve
    from finetune.train import grpo_trainer

    folder = reward_model_folder(tmp_path, tiny_model_cfg)
    cfg = resolve(
        tiny_cfg(*GRPO_RUN, f"objective.reward_model={folder}", "objective.reward_model_weight=0.5")
    )
    rewards = grpo_trainer.configured_rewards(cfg.objective)
    assert grpo_trainer.reward_weights(cfg.objective, rewards) == [1.0, 0.5]
    sources = grpo_trainer.reward_sources(cfg, tokenizer=None)
    funcs, classes = sources["reward_funcs"], sources["reward_processing_classes"]
    assert [getattr(f, "__name__", None) for f in funcs[:1]] == ["exact_match"] and classes[0] is None
    learned = funcs[1]
    assert type(learned).__name__ == "LlamaForSequenceClassification" and not learned.training
    assert not any(p.requires_grad for p in learned.parameters())
    assert classes[1].get_vocab() == load_tokenizer(cfg.model).get_vocab()
    alone = resolve(tiny_cfg(*GRPO_RUN, "objective.rewards=[]", f"objective.reward_model={folder}"))
    assert grpo_trainer.reward_weights(alone.objective, grpo_trainer.configured_rewards(alone.objective)) == [
        1.0
    ]


def _not_a_reward_model(tmp_path: Path, tiny_model_cfg) -> dict[str, tuple[str, str]]:  # type: ignore[no-untyped-def]
    from finetune.modeling import tiny

    sft_run = tmp_path / "sft-run"
    sft_run.mkdir()
    (sft_run / "config.yaml").write_text(yaml.safe_dump({"objective": {"name": "sft"}}))
    base = tiny.model_dir(tiny_model_cfg)
    return {
        "nothing": (
            str(tmp_path / "missing"),
            "neither a reward-model run directory (config.yaml) nor a model folder",
        ),
        "base model": (str(base), "not a reward model (config.json: LlamaForCausalLM, 2 labels)"),
        "sft run": (str(sft_run), "a run of objective=sft, which trains no reward model"),
    }


def test_what_is_not_a_reward_model_is_one_line(tiny_cache, tiny_model_cfg, tmp_path):
    for path, message in _not_a_reward_model(tmp_path, tiny_model_cfg).values():
        with pytest.raises(ConfigError, match=r"objective\.reward_model=") as caught:
            tiny_cfg(*GRPO_RUN, f"objective.reward_model={path}")
        assert message in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="name at least one reward, or set objective.reward_model"):
        tiny_cfg(*GRPO_RUN, "objective.rewards=[]")


def test_a_reward_model_with_another_vocabulary_is_refused(tiny_cache, tiny_model_cfg, tmp_path):
    from finetune.modeling import reward_model

    folder = reward_model_folder(tmp_path, tiny_model_cfg, extra_token=True)
    with pytest.raises(
        ConfigError,
        match=r"objective.reward_model=.*its tokenizer is not the policy's \(513 tokens against 512\)",
    ):
        reward_model.load(str(folder), tiny_model_cfg, dtype=None)


def test_the_command_line_refuses_a_base_model_as_the_reward_model_exit_2(
    tiny_cache, tiny_model_cfg, tmp_path
):
    from finetune.modeling import tiny

    proc = run_cli(
        *GRPO_RUN,
        f"objective.reward_model={tiny.model_dir(tiny_model_cfg)}",
        "mode=plan",
        f"run_dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "objective.reward_model=" in lines[-1] and "not a reward model" in lines[-1]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_grpo_trains_and_is_evaluated_with_the_learned_reward(tiny_cache, tiny_model_cfg, tmp_path):
    """Two GRPO steps on exact_match plus the reward model at weight 0.5: TRL's logged reward is the weighted sum
    of the two means; the evaluation's reward_model_score is the reward model's mean score of each model's answers,
    recomputed here, and mean_reward adds it at its weight."""
    from finetune.core import rewards
    from finetune.data.stage import load_prepared
    from finetune.evaluation import stage as eval_stage
    from finetune.evaluation.reward_scores import Scorer
    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    folder = reward_model_folder(tmp_path, tiny_model_cfg)
    cfg = tiny_cfg(
        *GRPO_RUN, "train.max_steps=2", f"objective.reward_model={folder}", "objective.reward_model_weight=0.5",
        run_dir=tmp_path / "run",
    )  # fmt: skip
    cfg = resolve(cfg)
    run = prepare_run(cfg)
    metrics = stage.run(cfg, run, plan_stage(cfg, run, quiet=True))
    grpo = metrics["train"]["grpo"]
    assert set(grpo["rewards"]) == {"exact_match", "reward_model"}
    for which in ("first", "last"):
        expected = grpo["rewards"]["exact_match"][which] + 0.5 * grpo["rewards"]["reward_model"][which]
        assert grpo["reward"][which] == pytest.approx(expected, abs=1e-4)
    # an untrained head scores every completion, not a constant
    assert grpo["rewards"]["reward_model"]["first"] != 0.0
    cfg = replace(cfg, eval=replace(cfg.eval, num_samples=4, regression=False))
    evaluated = eval_stage.run(cfg, run)
    rows = [json.loads(x) for x in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    task = [r for r in rows if r["set"] == "task"]
    items = eval_stage.task_items(load_prepared(run)[1], 4)
    scorer = Scorer(cfg, run, None, None, ["base"])
    resolved = rewards.for_objective(cfg)
    assert resolved is not None
    for v in ("base", "trained"):
        learned = scorer.learned_scores(items, [r[v] for r in task])
        assert evaluated[v]["reward_model_score"] == pytest.approx(sum(learned) / 4, abs=1e-5)
        summed, _ = rewards.total(
            resolved, [r["prompt"] for r in task], [r[v] for r in task], [r["reference"] for r in task]
        )
        assert evaluated[v]["mean_reward"] == pytest.approx(
            sum(summed) / 4 + 0.5 * sum(learned) / 4, abs=1e-5
        )


def test_a_reward_model_run_directory_is_read_as_its_export_or_refused_until_trained(
    tiny_cache, tiny_model_cfg, tmp_path
):
    import shutil

    from finetune import rundir
    from finetune.modeling import reward_model

    run = tmp_path / "rm-run"
    run.mkdir()
    rundir.save_config(tiny_cfg("objective=reward", "method=full"), run)
    with pytest.raises(ConfigError, match=r"the reward-model run has no trained output yet"):
        reward_model.find(str(run))
    shutil.copytree(reward_model_folder(tmp_path, tiny_model_cfg), rundir.merged_dir(run))
    source = reward_model.find(str(run))
    assert (source.variant, source.run_config.objective.name) == ("merged", "reward")
    model, tokenizer = reward_model.load(str(run), tiny_model_cfg, dtype=None)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert OBJECTIVES["grpo"].companions_of(tiny_cfg(*GRPO_RUN, f"objective.reward_model={run}").objective)[
        0
    ].model == str(run)
