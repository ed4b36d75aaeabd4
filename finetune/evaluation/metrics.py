"""Task metrics on generated answers: built-ins, a regex extractor, or a user function by dotted path.

Every metric takes (prompts, predictions, references) and returns {name: value};
`resolve` turns `eval.metrics` into those callables before any model is loaded,
so a misspelt function fails in a second, not after an hour of generation.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from finetune.core import tasks
from finetune.core.config.evaluation import REGEX_PREFIX, check_metric_name
from finetune.core.errors import ConfigError

Metric = Callable[[Sequence[str], Sequence[str], Sequence[str]], dict[str, float]]


def _mean(hits: Sequence[bool]) -> float:
    return sum(hits) / len(hits) if hits else 0.0


def exact_match(
    prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    """Normalised exact match, broken down per task on the bundled data (`finetune.core.tasks.score`)."""
    return tasks.score(prompts, predictions, references)


def contains(
    prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    """The normalised reference appears in the normalised answer."""
    hits = [tasks.normalize_answer(r) in tasks.normalize_answer(p) for p, r in zip(predictions, references)]
    return {"contains": _mean(hits)}


def regex_metric(pattern: str, name: str) -> Metric:
    """The pattern's first group (or whole match) found in the answer, compared with the reference."""
    compiled = re.compile(pattern)

    def metric(
        prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]
    ) -> dict[str, float]:
        hits = []
        for prediction, reference in zip(predictions, references):
            m = compiled.search(prediction)
            extracted = (m.group(1) if m and compiled.groups else m.group(0)) if m else None
            hits.append(extracted is not None and tasks.exact_match(extracted, reference))
        return {name: _mean(hits)}

    return metric


def import_function(path: str, key: str) -> Callable[..., Any]:
    """The function at a dotted path (`package.module.function`), or a one-line error naming `key`."""
    module_name, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key}: cannot import {path!r} ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"{key}: {path!r} is not a function")
    return fn


def _user_function(path: str) -> Metric:
    attr = path.rpartition(".")[2]
    fn = import_function(path, "eval.metrics")

    def metric(
        prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]
    ) -> dict[str, float]:
        value: Any = fn(list(prompts), list(predictions), list(references))
        if isinstance(value, dict):
            return {str(k): float(v) for k, v in value.items()}
        return {attr: float(value)}

    return metric


def resolve(names: Sequence[str]) -> list[Metric]:
    """`eval.metrics` as callables; user functions are imported here (fail fast)."""
    metrics: list[Metric] = []
    regexes = sum(n.startswith(REGEX_PREFIX) for n in names)
    for i, name in enumerate(names):
        check_metric_name(name)
        if name == "exact_match":
            metrics.append(exact_match)
        elif name == "contains":
            metrics.append(contains)
        elif name.startswith(REGEX_PREFIX):
            label = "regex_match" if regexes == 1 else f"regex_match_{i}"
            metrics.append(regex_metric(name[len(REGEX_PREFIX) :], label))
        else:
            metrics.append(_user_function(name))
    return metrics


def score(
    metrics: Sequence[Metric], prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    result: dict[str, float] = {}
    for metric in metrics:
        result.update(metric(prompts, predictions, references))
    return result
