"""bench_dpo_overhead's like-for-like check: the two sides' DPOConfig compared field by field.

TRL's DPOConfig turns activation checkpointing on by default; a plain script that kept it while the plan turned
it off recomputes every forward and reads as finetune being 21% faster (BENCHMARKS.md). So the benchmark stops on
any field that differs but where each side saves.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from helpers import script_module


def _args(tmp_path: Path, **kwargs) -> dict:
    from trl import DPOConfig

    with warnings.catch_warnings():
        # TRL's default sets the deprecated alias (gradient_checkpointing=True), which transformers warns about
        warnings.simplefilter("ignore", FutureWarning)
        args = DPOConfig(use_cpu=True, bf16=False, report_to=[], **kwargs).to_dict()
    return json.loads(
        json.dumps(args, default=str)
    )  # as the plain script writes them and the benchmark reads


def test_activation_checkpointing_left_on_is_a_difference_and_the_output_folders_are_not(tmp_path: Path):
    differences = script_module("bench_dpo_overhead").argument_differences
    ours = _args(tmp_path, output_dir=str(tmp_path / "a"), activation_checkpointing=False, save_total_limit=2)
    # TRL's default: activation checkpointing on; another output folder, no rotation
    plain = _args(tmp_path, output_dir=str(tmp_path / "b"))
    assert differences(ours, plain) == [
        "activation_checkpointing: False != True",
        "gradient_checkpointing: False != True",
    ]
    same = _args(tmp_path, output_dir=str(tmp_path / "c"), activation_checkpointing=False)
    assert differences(ours, same) == []
