"""Schema of the `data` config group (the data preparation stage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from finetune.core.errors import ConfigError


@dataclass
class DataConfig:
    name: str = "bundled"
    # A file (JSONL, JSON, Parquet, CSV), a folder of them, a `save_to_disk`
    # folder or a hub data set name. None: the data set bundled with finetune.
    path: Optional[str] = None
    # messages | prompt_completion | alpaca | auto (detected from the fields)
    format: str = "auto"
    # Field names, mapped to messages by `format`.
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    system_prompt: Optional[str] = None
    # Which tokens carry labels: assistant (all assistant turns) | all | last (last assistant turn)
    train_on: str = "assistant"
    eval_fraction: float = 0.1
    seed: int = 1234
    # Cleaning, each step on by default.
    dedup: bool = True
    near_dedup: bool = True
    near_dedup_threshold: float = 0.85
    min_tokens: int = 4
    max_tokens: Optional[int] = None  # None: train.seq_len
    too_long: str = "drop"  # drop | truncate
    check_roles: bool = True
    scrub_pii: bool = True
    on_error: str = "raise"  # raise | skip
    # Message content holding the tokenizer's special tokens or the chat template's markers (<|user|>, ...):
    # drop the sample (counted as control_tokens), escape them (a zero-width space after their first
    # character, so they tokenize as plain text), or keep them (they become real control tokens).
    control_tokens: str = "drop"  # drop | escape | keep
    # train.seq_len=auto takes this percentile of kept lengths (100: the longest).
    seq_len_percentile: float = 100.0
    packing: bool = True
    num_proc: int = 1
    cache_dir: Optional[str] = None  # None: ~/.cache/finetune/data
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        choices = {
            "format": ("auto", "messages", "prompt_completion", "alpaca"),
            "train_on": ("assistant", "all", "last"),
            "too_long": ("drop", "truncate"),
            "on_error": ("raise", "skip"),
            "control_tokens": ("drop", "escape", "keep"),
        }
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"data.{key}={getattr(self, key)!r} is not one of {', '.join(valid)}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if not 0.0 < self.near_dedup_threshold <= 1.0:
            raise ConfigError(f"data.near_dedup_threshold={self.near_dedup_threshold} must be in (0, 1]")
        if not 0.0 < self.seq_len_percentile <= 100.0:
            raise ConfigError(f"data.seq_len_percentile={self.seq_len_percentile} must be in (0, 100]")
        if self.min_tokens < 0:
            raise ConfigError(f"data.min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ConfigError(f"data.max_tokens={self.max_tokens} must be > 0")
        if self.num_proc < 1:
            raise ConfigError(f"data.num_proc={self.num_proc} must be >= 1")
