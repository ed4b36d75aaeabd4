"""Task metrics on generated answers: built-ins, a regex extractor, or a user function by dotted path.

Every metric takes (prompts, predictions, references) and returns {name: value};
`resolve` turns `eval.metrics` into those callables before any model is loaded,
so a misspelt function fails in a second, not after an hour of generation.

User code runs fenced (`call_fenced`, shared with the rewards): in a thread of its own, under a time
limit, and whatever it raises, `SystemExit` and `KeyboardInterrupt` included, becomes one line naming the
function (exit 2). So a user function can neither end the run as a success, nor hang it, nor pass for a
signal; and the main thread stays free to honour SIGTERM while it waits.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

from finetune.core import tasks
from finetune.core.config.evaluation import REGEX_PREFIX, EvalConfig, check_metric_name
from finetune.core.errors import ConfigError, FinetuneError

Metric = Callable[[Sequence[str], Sequence[str], Sequence[str]], dict[str, float]]


def call_fenced(
    fn: Callable[[], Any],
    what: str,
    timeout_s: Optional[float],
    setting: Optional[str] = None,
    error: type[FinetuneError] = ConfigError,
) -> Any:
    """`fn()` run in a daemon thread and waited for at most `timeout_s` seconds (None: no limit); anything it
    raises, or its not returning in time (`setting`: the setting that sets the limit), becomes `error` naming
    `what`.

    A thread, not a signal alarm: it works in any thread and stops code that never returns to the interpreter
    as surely as a sleeping one (the thread is abandoned; the run ends with exit 2). The main thread's wait
    stays interruptible, so SIGTERM and SIGINT act at once.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # SystemExit and KeyboardInterrupt from user code are its failures too
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"finetune-user-code {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        slow = f"fix it, or raise {setting} if it is only slow" if setting else "fix it"
        raise error(
            f"{what} did not return within {timeout_s:g} s"
            + (f" ({setting})" if setting else "")
            + f"; {slow}"
        )
    exc = outcome.get("error")
    if exc is None:
        return outcome.get("value")
    if isinstance(exc, SystemExit):
        raise error(f"{what} called sys.exit({exc.code!r}); user code must return a value, not end the run")
    if isinstance(exc, FinetuneError):
        raise exc
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    raise error(f"{what} raised {type(exc).__name__}" + (f": {first}" if first else ""))


def as_number(value: Any) -> Optional[float]:
    """`value` as a float when it is one real number: int, float, bool, a numpy scalar, a 0-d array or
    tensor; None otherwise (a string, a list, None, a complex number)."""
    if isinstance(value, (str, bytes)):
        return None
    if not isinstance(value, numbers.Real) and getattr(value, "shape", None) == ():
        value = value.item()  # a 0-d numpy array or torch tensor
    return float(value) if isinstance(value, numbers.Real) else None


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


def import_function(
    path: str, key: str, timeout_s: Optional[float], limit: Optional[str] = None
) -> Callable[..., Any]:
    """The function at a dotted path (`package.module.function`), or a one-line error naming `key`. The
    module's own code runs fenced (`call_fenced`): an import that exits, raises or hangs is one line."""
    module_name, _, attr = path.rpartition(".")

    def load() -> Any:
        try:
            return importlib.import_module(module_name)
        except ImportError as exc:  # not there: said as such, not as the module's failure
            return exc

    module = call_fenced(load, f"importing {module_name!r} ({key})", timeout_s, limit)
    fn = getattr(module, attr, None) if not isinstance(module, ImportError) else None
    if fn is None:
        why = (
            module if isinstance(module, ImportError) else f"module {module_name!r} has no attribute {attr!r}"
        )
        raise ConfigError(f"{key}: cannot import {path!r} ({why})")
    if not callable(fn):
        raise ConfigError(f"{key}: {path!r} is not a function")
    return fn


# The setting a user metric's time limit comes from, named in the line that says it ran out.
_TIMEOUT_SETTING = "eval.metric_timeout_s"


def _user_function(path: str, timeout_s: Optional[float]) -> Metric:
    attr = path.rpartition(".")[2]
    fn = import_function(path, "eval.metrics", timeout_s, _TIMEOUT_SETTING)
    what = f"metric {path!r}"

    def metric(
        prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]
    ) -> dict[str, float]:
        value: Any = call_fenced(
            lambda: fn(list(prompts), list(predictions), list(references)), what, timeout_s, _TIMEOUT_SETTING
        )
        named = value if isinstance(value, dict) else {attr: value}
        out = {}
        for name, v in named.items():
            number = as_number(v)
            if number is None or not math.isfinite(number):
                raise ConfigError(f"{what} returned {str(name)!r}: {v!r:.80}, not a finite number")
            out[str(name)] = number
        return out

    return metric


def resolve(names: Sequence[str], timeout_s: Optional[float] = EvalConfig.metric_timeout_s) -> list[Metric]:
    """`eval.metrics` as callables; user functions are imported here (fail fast) and run fenced (`call_fenced`),
    each call under `timeout_s` seconds (eval.metric_timeout_s; None: no limit)."""
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
            metrics.append(_user_function(name, timeout_s))
    return metrics


def score(
    metrics: Sequence[Metric], prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    result: dict[str, float] = {}
    for metric in metrics:
        result.update(metric(prompts, predictions, references))
    return result
