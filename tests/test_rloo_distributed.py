"""RLOO on two CPU ranks through the CLI's modes: DDP (the representative, in CI), ZeRO-3 and FSDP2 (extended).

Each rank samples its share of the groups with transformers' generation (under ZeRO-3 from the gathered
weights, TRL's ds3_gather_for_generation); TRL gathers the rewards so every completion's leave-one-out baseline
sees its whole group. The engine record (metrics.json's train.engine) shows the engine really ran: the wrapper,
the world size, both ranks' pids and each rank's share of the parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SHORT_RUN, run_modes

RLOO_TWO_RANKS = (
    "objective=rloo",
    "train.batch_size=4",
    "objective.num_generations=4",
    "objective.max_completion_length=6",
    "method.precision=bf16",
    "hardware=cpu",
    "hardware.gpus_per_node=2",
    "train.micro_batch_size=2",
    "train.grad_accum_steps=1",
    "train.max_steps=2",
    "train.save_steps=2",
    *SHORT_RUN,
)


def _two_ranks(tmp_path: Path, *engine: str) -> dict:
    run = tmp_path / "run"
    run_modes([*RLOO_TWO_RANKS, *engine, f"run_dir={run}"], run, timeout=1800)
    train = json.loads((run / "metrics.json").read_text())["train"]
    record = train["engine"]
    assert record["world_size"] == 2 and len({r["pid"] for r in record["ranks"]}) == 2
    assert record["micro_batch_size"] == 2  # each rank's 2 completions of a step's 4 (one group)
    assert train["steps"] == 2 and train["rloo"]["logged_steps"] == 2
    assert 0 < train["rloo"]["completion_mean_length"]["last"] <= 6
    assert "kl" in train["rloo"]  # beta = 0.05: the reference forward ran on each rank
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    return dict(record)


@pytest.mark.slow
@pytest.mark.distributed
def test_rloo_under_ddp_on_two_cpu_ranks(tiny_cache: Path, tmp_path: Path) -> None:
    record = _two_ranks(tmp_path)
    assert record["wrapper"] == "DistributedDataParallel" and record["backend"] == "gloo"
    # replicated: each rank holds every parameter
    assert all(r["parameters_held"] == r["parameters"] for r in record["ranks"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended
def test_rloo_under_zero3_on_two_cpu_ranks(tiny_cache: Path, tmp_path: Path) -> None:
    record = _two_ranks(tmp_path, "train.sharding=zero3", "train.engine=zero3")
    assert record["wrapper"].startswith("DeepSpeedEngine") and record["zero_stage"] == 3
    # partitioned: each rank holds about half of the parameters
    for r in record["ranks"]:
        assert r["parameters_held"] == pytest.approx(r["parameters"] / 2, rel=0.05)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended
def test_rloo_under_fsdp2_on_two_cpu_ranks(tiny_cache: Path, tmp_path: Path) -> None:
    record = _two_ranks(tmp_path, "train.sharding=fsdp", "train.engine=fsdp")
    assert record["wrapper"].startswith("FSDP")
    for r in record["ranks"]:
        assert r["parameters_held"] == pytest.approx(r["parameters"] / 2, rel=0.05)
