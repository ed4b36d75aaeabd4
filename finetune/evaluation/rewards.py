"""Verifiable rewards: one number per completion, from the prompt's reference answer.

The names are those of `eval.metrics` (`exact_match`, `contains`, `regex:<pattern>`, or a user
function by dotted path, imported by the same loader), plus `format:<pattern>` (the whole completion
matches the pattern: a format reward). A metric averages over the rows; a reward keeps one value per
completion, so GRPO can rank the generations of one prompt against each other.

A user reward is `fn(prompts, completions, references) -> sequence of numbers`, one per completion.
One that raises, or returns anything but one finite number per completion, stops the run with a
`RewardError` naming it: TRL would otherwise turn a `None` into NaN and train on it, or fail with a
traceback in the middle of a step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from finetune.core import tasks
from finetune.core.config import Config
from finetune.core.config.evaluation import REGEX_PREFIX
from finetune.core.config.grpo import FORMAT_PREFIX, check_reward_name
from finetune.core.errors import ConfigError, RewardError
from finetune.evaluation.metrics import import_function

Score = Callable[[Sequence[str], Sequence[str], Sequence[str]], Sequence[Any]]


def _exact_match(
    prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> list[float]:
    return [float(tasks.exact_match(c, r)) for c, r in zip(completions, references)]


def _contains(prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]) -> list[float]:
    return [
        float(tasks.normalize_answer(r) in tasks.normalize_answer(c)) for c, r in zip(completions, references)
    ]


def _regex(pattern: str) -> Score:
    compiled = re.compile(pattern)

    def score(prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]) -> list[float]:
        out = []
        for completion, reference in zip(completions, references):
            m = compiled.search(completion)
            extracted = (m.group(1) if compiled.groups else m.group(0)) if m else None
            out.append(float(extracted is not None and tasks.exact_match(extracted, reference)))
        return out

    return score


def _format(pattern: str) -> Score:
    compiled = re.compile(pattern)

    def score(prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]) -> list[float]:
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return score


@dataclass(frozen=True)
class Reward:
    """One named reward and its weight in the sum GRPO ranks generations by."""

    name: str
    weight: float
    fn: Score

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
    ) -> list[float]:
        """One finite float per completion, or a `RewardError` naming this reward."""
        try:
            values = self.fn(list(prompts), list(completions), list(references))
        except Exception as exc:  # a user function's own failure, reported as one line naming it
            raise RewardError(f"reward {self.name!r} raised {type(exc).__name__}: {exc}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"reward {self.name!r} returned {type(values).__name__}, not one number per completion"
            ) from None
        if len(values) != len(completions):
            raise RewardError(
                f"reward {self.name!r} returned {len(values)} values for {len(completions)} completions"
            )
        out = []
        for i, value in enumerate(values):
            # bool is an int: True/False are the natural pass/fail of a verifiable reward
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(
                    f"reward {self.name!r} returned {value!r} for completion {i}, not a finite number"
                )
            out.append(float(value))
        return out


def _reward_fn(name: str, key: str) -> Score:
    if name == "exact_match":
        return _exact_match
    if name == "contains":
        return _contains
    if name.startswith(REGEX_PREFIX):
        return _regex(name[len(REGEX_PREFIX) :])
    if name.startswith(FORMAT_PREFIX):
        return _format(name[len(FORMAT_PREFIX) :])
    return import_function(name, key)


def resolve(
    names: Sequence[str], weights: Optional[Sequence[float]] = None, key: str = "objective.rewards"
) -> list[Reward]:
    """The configured rewards as callables, user functions imported here (fail before a model loads)."""
    if not names:
        raise ConfigError(
            f"{key}: name at least one reward (exact_match, contains, regex:, format: or a function)"
        )
    if weights is not None and len(weights) != len(names):
        raise ConfigError(f"{key}: {len(names)} rewards but {len(weights)} reward_weights")
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: a reward is named twice ({list(names)})")
    rewards = []
    for i, name in enumerate(names):
        check_reward_name(name, key)
        weight = 1.0 if weights is None else float(weights[i])
        rewards.append(Reward(name, weight, _reward_fn(name, key)))
    return rewards


def total(
    rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum per completion (what GRPO ranks by) and each reward's own values."""
    each = {r.name: r.score(prompts, completions, references) for r in rewards}
    summed = [sum(r.weight * each[r.name][i] for r in rewards) for i in range(len(completions))]
    return summed, each


def pass_rate(rewards: Sequence[Reward], each: dict[str, list[float]]) -> float:
    """Share of completions that earn every reward's full value (1 for the built-ins: the answer checks)."""
    if not each or not next(iter(each.values())):
        return 0.0
    n = len(next(iter(each.values())))
    return sum(all(each[r.name][i] >= 1.0 for r in rewards) for i in range(n)) / n


def for_objective(cfg: Config) -> Optional[list[Reward]]:
    """The rewards the run's objective trains on (its settings' `rewards`, GRPO's), resolved; None for
    an objective without rewards. The evaluation scores every model's answers with them, so the report says
    whether the policy earns more of what it was trained to earn."""
    names = getattr(cfg.objective, "rewards", None)
    if not names:
        return None
    return resolve(names, getattr(cfg.objective, "reward_weights", None), key="objective.rewards")


def scores(
    rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    """One model's reward metrics on its held-out answers: `mean_reward` (the weighted sum GRPO ranks by,
    averaged) and `pass_rate` (the share of answers earning every reward's full value). Empty without answers."""
    if not completions:
        return {}
    summed, each = total(rewards, prompts, completions, references)
    return {"mean_reward": sum(summed) / len(summed), "pass_rate": pass_rate(rewards, each)}
