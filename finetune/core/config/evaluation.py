"""Schema of the `eval` config group: what evaluation scores, and how it generates.

Base, fine-tuned and merged models are scored with the same chat template,
the same prompts and the same sampling settings (greedy unless `greedy=false`),
so differences come from the weights alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from finetune.core.config.checks import check_positive
from finetune.core.errors import ConfigError

BUILTIN_METRICS = ("exact_match", "contains")
REGEX_PREFIX = "regex:"

# Phrases that open a refusal; a fine-tuned model that starts refusing a prompt the base answered is flagged.
DEFAULT_REFUSAL_PATTERN = (
    r"(?i)^\W*(i'?m sorry|sorry,|i (can ?not|can't|won't|will not|am unable|'m unable|am not able)"
    r"|as an ai\b|i must (decline|refuse)|unfortunately,? i (can't|cannot))"
)


def check_metric_name(name: str, key: str = "eval.metrics") -> None:
    """exact_match | contains | regex:<pattern> | package.module.function (checked here, imported at run time)."""
    if name in BUILTIN_METRICS:
        return
    if name.startswith(REGEX_PREFIX):
        try:
            re.compile(name[len(REGEX_PREFIX) :])
        except re.error as exc:
            raise ConfigError(f"{key}: {name!r} is not a valid regular expression ({exc})") from None
        return
    if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", name):
        return
    raise ConfigError(
        f"{key}: {name!r} is not exact_match, contains, regex:<pattern> or a dotted path to a function"
    )


@dataclass
class EvalConfig:
    """`python -m finetune mode=eval`: held-out loss, task metrics and a regression set, base vs fine-tuned."""

    # Task metrics on the held-out split's generations: exact_match (with a per-task breakdown on the
    # bundled data), contains (the reference appears in the answer), regex:<pattern> (the pattern's
    # first group, or whole match, extracted from the answer equals the reference), or
    # package.module.function(prompts, predictions, references) -> float | dict[str, float].
    metrics: list[str] = field(default_factory=lambda: ["exact_match"])
    # How long one call of a user metric function may take (importing its module, or scoring all the
    # answers of one model at once); past it the evaluation stops with one line naming the metric (exit 2).
    metric_timeout_s: float = 600.0
    # Held-out conversations answered by generation (None: all); the loss always uses the whole split.
    num_samples: Optional[int] = 256
    # General prompts whose answers must not regress (new refusals, empty answers, failed checks).
    regression: bool = True
    regression_prompts: Optional[str] = None  # a JSONL file; None: the set bundled with finetune
    # Generation: the same settings for every model compared.
    max_new_tokens: int = 64
    batch_size: int = 16
    greedy: bool = True
    temperature: float = 0.7  # used when greedy=false
    top_p: float = 0.95  # used when greedy=false
    seed: int = 0  # sampling seed, reset before each model so all see the same random stream
    refusal_pattern: str = DEFAULT_REFUSAL_PATTERN
    # Samples shown in report.md (all of them are in samples.jsonl).
    report_examples: int = 8
    progress: bool = True
    # EleutherAI's lm-evaluation-harness on every model compared (finetune[lm-eval], docs/export.md): task names
    # (mmlu, gsm8k, ifeval: the Hub must be reachable) or a task YAML file of the harness's format; [] for none.
    lm_eval_tasks: list[str] = field(default_factory=list)
    lm_eval_limit: Optional[int] = None  # examples a task (None: all)
    lm_eval_chat_template: bool = (
        True  # prompts through the tokenizer's chat template, as the model was trained
    )

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ConfigError("eval.metrics is empty: name at least one metric (e.g. [exact_match])")
        for name in self.metrics:
            check_metric_name(name)
        if self.num_samples is not None and self.num_samples < 0:
            raise ConfigError(f"eval.num_samples={self.num_samples} must be >= 0, or null for all")
        check_positive("eval.metric_timeout_s", self.metric_timeout_s)
        for key in ("max_new_tokens", "batch_size"):
            check_positive(f"eval.{key}", getattr(self, key))
        if self.temperature <= 0:
            raise ConfigError(f"eval.temperature={self.temperature} must be > 0 (greedy=true for greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"eval.top_p={self.top_p} must be in (0, 1]")
        check_positive("eval.report_examples", self.report_examples, allow_zero=True)
        check_positive("eval.lm_eval_limit", self.lm_eval_limit, allow_none=True)
        try:
            re.compile(self.refusal_pattern)
        except re.error as exc:
            raise ConfigError(f"eval.refusal_pattern is not a valid regular expression ({exc})") from None
