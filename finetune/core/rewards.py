"""Verifiable rewards: one number per completion, from the prompt's reference answer.

The names are those of `eval.metrics` (`exact_match`, `contains`, `regex:<pattern>`, or a user
function by dotted path, imported by the same loader), plus `format:<pattern>` (the whole completion
matches the pattern: a format reward). A metric averages over the rows; a reward keeps one value per
completion, so GRPO can rank the generations of one prompt against each other.

A user reward is `fn(prompts, completions, references) -> sequence of numbers`, one per completion
(Python, numpy or 0-d torch numbers). It runs fenced (`metrics.call_fenced`): under `objective.reward_timeout_s`
a call, and one that raises (`SystemExit` and `KeyboardInterrupt` included), hangs, or returns anything
but one finite number per completion stops the run with a `RewardError` naming it (exit 2): TRL would
otherwise turn a `None` into NaN and train on it, or fail with a traceback in the middle of a step. A
weighted value beyond `WEIGHTED_LIMIT` is refused too: TRL sums and standardizes the rewards in float32,
where such values overflow to inf or lose every difference between completions.
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
from finetune.core.metrics import as_number, call_fenced, import_function

Score = Callable[[Sequence[str], Sequence[str], Sequence[str]], Sequence[Any]]

# The largest |weight x value| of one reward: the weighted sum, its group mean and spread stay finite and
# distinct in float32 (whose integers are exact only to 2^24), for any number of rewards a run names.
WEIGHTED_LIMIT = 1e6


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
    timeout_s: Optional[float] = None  # one call at most (objective.reward_timeout_s); None: no limit

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
    ) -> list[float]:
        """One finite float per completion, or a `RewardError` naming this reward."""
        what = f"reward {self.name!r}"

        def call() -> Any:
            values = self.fn(list(prompts), list(completions), list(references))
            # a generator or other lazy sequence runs its code here, inside the fence
            return values if isinstance(values, (str, bytes, dict)) else _listed(values)

        values = call_fenced(call, what, self.timeout_s, "objective.reward_timeout_s", RewardError)
        if not isinstance(values, list):
            raise RewardError(f"{what} returned {type(values).__name__}, not one number per completion")
        if len(values) != len(completions):
            raise RewardError(f"{what} returned {len(values)} values for {len(completions)} completions")
        out = []
        for i, value in enumerate(values):
            # bool is an int: True/False are the natural pass/fail of a verifiable reward
            number = as_number(value)
            if number is None or not math.isfinite(number):
                raise RewardError(f"{what} returned {value!r:.80} for completion {i}, not a finite number")
            if abs(self.weight * number) > WEIGHTED_LIMIT:
                raise RewardError(
                    f"{what} returned {number:g} for completion {i}, x weight {self.weight:g} beyond "
                    f"+-{WEIGHTED_LIMIT:g}: GRPO sums and standardizes rewards in float32; scale the reward down"
                )
            out.append(number)
        return out


def _listed(values: Any) -> Any:
    try:
        return list(values)
    except TypeError:
        return values


def _reward_fn(name: str, key: str, timeout_s: Optional[float]) -> Score:
    if name == "exact_match":
        return _exact_match
    if name == "contains":
        return _contains
    if name.startswith(REGEX_PREFIX):
        return _regex(name[len(REGEX_PREFIX) :])
    if name.startswith(FORMAT_PREFIX):
        return _format(name[len(FORMAT_PREFIX) :])
    return import_function(name, key, timeout_s, "objective.reward_timeout_s")


def resolve(
    names: Sequence[str],
    weights: Optional[Sequence[float]] = None,
    key: str = "objective.rewards",
    timeout_s: Optional[float] = None,
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
        if not math.isfinite(weight) or abs(weight) > WEIGHTED_LIMIT:
            raise ConfigError(
                f"{key}: the weight of {name!r} is {weight:g}; weights lie within +-{WEIGHTED_LIMIT:g}"
            )
        rewards.append(Reward(name, weight, _reward_fn(name, key, timeout_s), timeout_s))
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
    return resolve(
        names,
        getattr(cfg.objective, "reward_weights", None),
        key="objective.rewards",
        timeout_s=getattr(cfg.objective, "reward_timeout_s", None),
    )


def scores(
    rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    """One model's reward metrics on its held-out answers: `mean_reward` (the weighted sum GRPO ranks by,
    averaged) and `pass_rate` (the share of answers earning every reward's full value). Empty without answers."""
    if not completions:
        return {}
    summed, each = total(rewards, prompts, completions, references)
    return {"mean_reward": sum(summed) / len(summed), "pass_rate": pass_rate(rewards, each)}
