"""GRPO's rewards: one finite number per completion from the reference answer, or one line naming the reward."""

from __future__ import annotations

import math

import pytest

from finetune.core import rewards
from finetune.core.config.grpo import GRPOObjective
from finetune.core.errors import ConfigError, RewardError

PROMPTS = ["Even or odd: 12", "Even or odd: 7", "Sentiment: The movie was great.", "Parity of 3"]
COMPLETIONS = ["Even.", "even", "The answer is positive", "odd"]
REFERENCES = ["even", "odd", "positive", "odd"]


def scores(name: str) -> list[float]:
    (reward,) = rewards.resolve([name])
    return reward.score(PROMPTS, COMPLETIONS, REFERENCES)


def test_builtin_rewards_score_each_completion_against_its_reference() -> None:
    assert scores("exact_match") == [1.0, 0.0, 0.0, 1.0]
    assert scores("contains") == [1.0, 0.0, 1.0, 1.0]
    assert scores(r"regex:answer is (\w+)") == [0.0, 0.0, 1.0, 0.0]
    # a format reward looks at the completion only: a single word, optionally with a full stop
    assert scores(r"format:\w+\.?") == [1.0, 1.0, 0.0, 1.0]


def test_weighted_sum_and_pass_rate() -> None:
    resolved = rewards.resolve(["exact_match", r"format:\w+"], [1.0, 0.5])
    summed, each = rewards.total(resolved, PROMPTS, COMPLETIONS, REFERENCES)
    assert each["exact_match"] == [1.0, 0.0, 0.0, 1.0]
    assert each[r"format:\w+"] == [0.0, 1.0, 0.0, 1.0]
    assert summed == [1.0, 0.5, 0.0, 1.5]
    # every reward at its full value: only the last completion
    assert rewards.pass_rate(resolved, each) == 0.25
    # the evaluation's metrics of the same answers: the mean of the weighted sums, and that pass rate
    assert rewards.scores(resolved, PROMPTS, COMPLETIONS, REFERENCES) == {
        "mean_reward": 0.75,
        "pass_rate": 0.25,
    }
    assert rewards.scores(resolved, [], [], []) == {}


def test_the_evaluation_scores_with_the_objectives_rewards_only() -> None:
    from helpers import tiny_cfg

    assert rewards.for_objective(tiny_cfg()) is None  # SFT trains on no reward
    assert rewards.for_objective(tiny_cfg("objective=dpo")) is None
    cfg = tiny_cfg(
        "objective=grpo",
        "objective.num_generations=4",
        r"objective.rewards=[exact_match,'format:\w+']",
        "objective.reward_weights=[1.0,0.5]",
    )
    resolved = rewards.for_objective(cfg)
    assert resolved is not None
    assert [(r.name, r.weight) for r in resolved] == [("exact_match", 1.0), (r"format:\w+", 0.5)]


def test_user_reward_by_dotted_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(prompts, completions, references):\n"
        "    return [len(c) / 10 for c in completions]\n"
        "def broken(prompts, completions, references):\n"
        "    raise KeyError('answer')\n"
        "def words(prompts, completions, references):\n"
        "    return ['high' for c in completions]\n"
        "def short(prompts, completions, references):\n"
        "    return [1.0]\n"
        "def nan(prompts, completions, references):\n"
        "    return [float('nan')] * len(completions)\n"
        "def none(prompts, completions, references):\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert scores("my_rewards.length_bonus") == [0.5, 0.4, 2.2, 0.3]
    cases = {
        "my_rewards.broken": "reward 'my_rewards.broken' raised KeyError: 'answer'",
        "my_rewards.words": "reward 'my_rewards.words' returned 'high' for completion 0, not a finite number",
        "my_rewards.short": "reward 'my_rewards.short' returned 1 values for 4 completions",
        "my_rewards.nan": "reward 'my_rewards.nan' returned nan for completion 0, not a finite number",
        "my_rewards.none": "reward 'my_rewards.none' returned NoneType, not one number per completion",
    }
    for name, message in cases.items():
        with pytest.raises(RewardError) as err:
            scores(name)
        assert str(err.value) == message
        assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_bad_reward_names_fail_before_any_model_loads() -> None:
    with pytest.raises(ConfigError, match=r"objective.rewards: cannot import 'no_such_module.fn'"):
        rewards.resolve(["no_such_module.fn"])
    with pytest.raises(ConfigError, match=r"'math.pi' is not a function"):
        rewards.resolve(["math.pi"])
    with pytest.raises(ConfigError, match=r"not a valid regular expression"):
        rewards.resolve(["format:(unclosed"])
    with pytest.raises(ConfigError, match=r"2 rewards but 1 reward_weights"):
        rewards.resolve(["exact_match", "contains"], [1.0])
    with pytest.raises(ConfigError, match=r"named twice"):
        rewards.resolve(["exact_match", "exact_match"])
    with pytest.raises(ConfigError, match=r"is not exact_match, contains"):
        rewards.resolve(["exact match"])
    assert math.isclose(rewards.resolve(["math.fsum"])[0].weight, 1.0)


def test_grpo_settings_refuse_what_grpo_cannot_run() -> None:
    with pytest.raises(ConfigError, match=r"objective.num_generations=1: GRPO compares at least 2"):
        GRPOObjective(num_generations=1)
    with pytest.raises(ConfigError, match=r"objective.reward_weights: 1 weights for 2 rewards"):
        GRPOObjective(rewards=["exact_match", "contains"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match=r"objective.generation='vllm'"):
        GRPOObjective(generation="vllm")
    with pytest.raises(ConfigError, match=r"objective.beta=-0.1"):
        GRPOObjective(beta=-0.1)
