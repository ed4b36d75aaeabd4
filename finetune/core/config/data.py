"""Schema of the `data` config group (the data preparation stage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from finetune.core.config.checks import NOT_DATA_KEY, check_choices, check_positive, choice
from finetune.core.errors import ConfigError


@dataclass
class DataConfig:
    name: str = field(default="bundled", metadata=NOT_DATA_KEY)
    # A file (JSONL, JSON, Parquet, CSV), a folder of them, a `save_to_disk`
    # folder or a hub data set name. None: the data set bundled with finetune.
    path: Optional[str] = field(default=None, metadata=NOT_DATA_KEY)  # the key holds its content
    # A hub data set's split (or a save_to_disk folder's), its configuration (`load_dataset`'s name: the
    # subset), and the revision read (a branch, tag or commit; None: the default branch).
    split: str = "train"
    subset: Optional[str] = None
    revision: Optional[str] = None
    # auto: detected from the fields, per record. `text`: plain text (continued pre-training): no chat
    # template, every token trained, an end-of-sequence token after each record.
    format: str = choice("auto", ("auto", "messages", "prompt_completion", "alpaca", "text"))
    # Field names, mapped to messages by `format`.
    messages_field: str = "messages"
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    # Preference pairs (objective=dpo): the better and the worse answer, beside `prompt_field` (or, without a
    # prompt, two whole conversations whose common prefix is the prompt).
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    # Unpaired examples (objective=kto): true where `completion_field` is a desirable answer to `prompt_field`.
    label_field: str = "label"
    system_prompt: Optional[str] = None
    # Which tokens carry labels: assistant (all assistant turns), all, or last (the last assistant turn).
    train_on: str = choice("assistant", ("assistant", "all", "last"))
    eval_fraction: float = 0.1
    seed: int = 1234
    # Cleaning, each step on by default.
    dedup: bool = True
    near_dedup: bool = True
    near_dedup_threshold: float = 0.85
    min_tokens: int = 4
    max_tokens: Optional[int] = None  # None: train.seq_len
    too_long: str = choice("drop", ("drop", "truncate"))
    check_roles: bool = True
    scrub_pii: bool = True
    on_error: str = choice("raise", ("raise", "skip"))
    # Message content holding the tokenizer's special tokens or the chat template's markers (<|user|>, ...):
    # drop the sample (counted as control_tokens), escape them (a zero-width space after their first
    # character, so they tokenize as plain text), or keep them (they become real control tokens).
    control_tokens: str = choice("drop", ("drop", "escape", "keep"))
    # train.seq_len=auto takes this percentile of kept lengths (100: the longest).
    seq_len_percentile: float = 100.0
    packing: bool = True
    num_proc: int = field(default=1, metadata=NOT_DATA_KEY)  # the same rows with more processes
    cache_dir: Optional[str] = field(default=None, metadata=NOT_DATA_KEY)  # None: ~/.cache/finetune/data
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choices(self, "data")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if not 0.0 < self.near_dedup_threshold <= 1.0:
            raise ConfigError(f"data.near_dedup_threshold={self.near_dedup_threshold} must be in (0, 1]")
        if not 0.0 < self.seq_len_percentile <= 100.0:
            raise ConfigError(f"data.seq_len_percentile={self.seq_len_percentile} must be in (0, 100]")
        check_positive("data.min_tokens", self.min_tokens, allow_zero=True)
        check_positive("data.max_tokens", self.max_tokens, allow_none=True)
        if not self.split.strip():
            raise ConfigError("data.split is empty: name a split (train, train_sft, ...)")
        if self.num_proc < 1:
            raise ConfigError(f"data.num_proc={self.num_proc} must be >= 1")
