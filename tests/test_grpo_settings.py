"""GRPO's loss settings reach TRL's GRPOConfig as set (loss_type, mask_truncated_completions), and a loss
type TRL does not know is refused in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_cfg

from finetune.core.errors import ConfigError
from finetune.core.rewards import resolve
from finetune.train.grpo_trainer import build_grpo_config

GROUPS = ("objective=grpo", "train.batch_size=8", "objective.num_generations=4")


def test_loss_settings_reach_grpo_config(tmp_path: Path) -> None:
    cfg = tiny_cfg(*GROUPS, "objective.loss_type=dr_grpo", "objective.mask_truncated_completions=true")
    args = build_grpo_config(
        cfg.objective, resolve(cfg.objective.rewards), tmp_path, generation="transformers", use_cpu=True
    )
    assert (args.loss_type, args.mask_truncated_completions) == ("dr_grpo", True)
    default = tiny_cfg(*GROUPS).objective
    args = build_grpo_config(
        default, resolve(default.rewards), tmp_path, generation="transformers", use_cpu=True
    )
    # TRL's own defaults, stated in our schema
    assert (args.loss_type, args.mask_truncated_completions) == ("dapo", False)


def test_unknown_loss_type_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        tiny_cfg(*GROUPS, "objective.loss_type=ppo")
    assert "objective.loss_type='ppo'" in str(err.value) and "\n" not in str(err.value)
