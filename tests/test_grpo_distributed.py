"""GRPO on two CPU ranks under DDP and FSDP2, through the CLI's modes (the ZeRO-3 run, the engine matrix's
representative, is tests/test_grpo_pipeline.py's): transformers' generation on each rank, the engine
record (the wrapper, the world size, both ranks' pids, each rank's share) checked, the rewards logged each step."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SHORT_RUN, run_on_engine

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.extended]

GRPO_TWO_RANKS = (
    "objective=grpo",
    "train.batch_size=4",
    "objective.num_generations=4",
    "objective.max_completion_length=6",
    "method.precision=bf16",
    "hardware=cpu",
    "train.micro_batch_size=2",
    "train.grad_accum_steps=1",
    *SHORT_RUN,
)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_grpo_on_two_cpu_ranks(engine: str, tiny_cache: Path, tmp_path: Path) -> None:
    run = run_on_engine(tmp_path, "run", engine, *GRPO_TWO_RANKS, steps=2, timeout=1800)
    train = run.metrics["train"]
    assert train["steps"] == 2 and train["grpo"]["logged_steps"] == 2
    assert 0 < train["grpo"]["completion_mean_length"]["last"] <= 6
    assert (run.dir / "adapter" / "adapter_model.safetensors").is_file()
