"""RLOO on two CPU ranks through the CLI's modes: DDP (the representative, in CI), ZeRO-3 and FSDP2 (extended).

Each rank samples its share of the groups with transformers' generation (under ZeRO-3 from the gathered
weights, TRL's ds3_gather_for_generation); TRL gathers the rewards so every completion's leave-one-out baseline
sees its whole group. The engine record (metrics.json's train.engine) shows the engine really ran: the wrapper,
the world size, both ranks' pids and each rank's share of the parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SHORT_RUN, run_on_engine

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

RLOO_TWO_RANKS = (
    "objective=rloo",
    "train.batch_size=4",
    "objective.num_generations=4",
    "objective.max_completion_length=6",
    "method.precision=bf16",
    "hardware=cpu",
    "train.micro_batch_size=2",
    "train.grad_accum_steps=1",
    *SHORT_RUN,
)


@pytest.mark.parametrize(
    "engine",
    [
        "ddp",
        pytest.param("zero3", marks=pytest.mark.extended),
        pytest.param("fsdp2", marks=pytest.mark.extended),
    ],
)
def test_rloo_on_two_cpu_ranks(engine: str, tiny_cache: Path, tmp_path: Path) -> None:
    run = run_on_engine(tmp_path, "run", engine, *RLOO_TWO_RANKS, steps=2, timeout=1800)
    train = run.metrics["train"]
    assert run.engine["micro_batch_size"] == 2  # each rank's 2 completions of a step's 4 (one group)
    assert train["steps"] == 2 and train["rloo"]["logged_steps"] == 2
    assert 0 < train["rloo"]["completion_mean_length"]["last"] <= 6
    assert "kl" in train["rloo"]  # beta = 0.05: the reference forward ran on each rank
    assert (run.dir / "adapter" / "adapter_model.safetensors").is_file()
