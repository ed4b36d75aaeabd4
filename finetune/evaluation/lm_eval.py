"""eval.lm_eval_tasks: EleutherAI's lm-evaluation-harness run on each model the evaluation compares.

The harness runs on the model already loaded for the variant (base, trained, merged), with the same tokenizer,
batch size and settings for each, so its scores differ only by the model. Scores land beside the others in
each variant of eval/metrics.json as `lm_eval/TASK/METRIC` (report.md shows them with their difference to
the base), and their deltas against the base under `lm_eval_deltas`.

A task is a name the harness knows (mmlu, gsm8k, ifeval: their data comes from the Hub) or a YAML file in the
harness's task format (its folder is added to the harness's task search path), e.g. a local JSONL data set.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import yaml

from finetune.core import userfiles
from finetune.core.config.evaluation import EvalConfig
from finetune.core.errors import ConfigError

PREFIX = "lm_eval/"
# The harness's result fields that are no scores (how many examples a task had).
_NOT_SCORES = ("sample_len", "sample_count")


def check(e: EvalConfig) -> None:
    """One line before any model loads: the harness installed, each task file readable."""
    if not e.lm_eval_tasks:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("eval.lm_eval_tasks needs lm-evaluation-harness: pip install 'finetune[lm-eval]'")
    _tasks(e)


def _tasks(e: EvalConfig) -> tuple[list[str], list[str]]:
    """(task names, folders to add to the harness's search path): a YAML file names its own task."""
    names, folders = [], []
    for task in e.lm_eval_tasks:
        path = Path(task).expanduser()
        if path.suffix in (".yaml", ".yml"):
            try:
                doc = yaml.safe_load(userfiles.read_text(path, "eval.lm_eval_tasks"))
            except yaml.YAMLError as exc:
                raise ConfigError(f"eval.lm_eval_tasks: {path}: not a readable task YAML ({exc})") from None
            if not isinstance(doc, dict) or not doc.get("task"):
                raise ConfigError(
                    f"eval.lm_eval_tasks: {path}: no `task:` name in it (the harness's task format)"
                )
            names.append(str(doc["task"]))
            folders.append(str(path.resolve().parent))
        else:
            names.append(task)
    return names, list(dict.fromkeys(folders))


def scores(e: EvalConfig, model: Any, tokenizer: Any) -> dict[str, float]:
    """The harness's scores of `model` on eval.lm_eval_tasks, `lm_eval/TASK/METRIC` (stderr left out)."""
    if not e.lm_eval_tasks:
        return {}
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    names, folders = _tasks(e)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=e.batch_size, max_length=None)
    chat = e.lm_eval_chat_template and tokenizer.chat_template is not None
    out = simple_evaluate(
        model=lm, tasks=names, task_manager=TaskManager(include_path=folders or None), limit=e.lm_eval_limit,
        apply_chat_template=chat, log_samples=False, random_seed=e.seed, numpy_random_seed=e.seed,
        torch_random_seed=e.seed, fewshot_random_seed=e.seed,
    )  # fmt: skip
    found: dict[str, float] = {}
    for task, metrics in (out or {}).get("results", {}).items():
        for key, value in metrics.items():
            name = key.split(",")[0]
            if name in _NOT_SCORES or name.endswith("_stderr") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                found[f"{PREFIX}{task}/{name}"] = float(value)
    return found


def deltas(result: dict[str, Any]) -> dict[str, Any]:
    """{"lm_eval_deltas": {VARIANT: {KEY: score - base's}}} for trained and merged; {} without harness scores."""
    base = result.get("base") or {}
    out = {
        v: {
            k: result[v][k] - base[k]
            for k in result[v]
            if k.startswith(PREFIX) and isinstance(base.get(k), float)
        }
        for v in ("trained", "merged")
        if isinstance(result.get(v), dict)
    }
    out = {v: d for v, d in out.items() if d}
    return {"lm_eval_deltas": out} if out else {}
