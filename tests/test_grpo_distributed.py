"""GRPO on two CPU ranks under DDP and FSDP2, through the CLI's modes (the ZeRO-3 run, the engine matrix's
representative, is tests/test_grpo_pipeline.py's): transformers' generation on each rank, the engine
record (engine.json's wrapper, world size, both ranks' pids) checked, the rewards logged each step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SHORT_RUN, run_modes

GRPO_TWO_RANKS = (
    "objective=grpo",
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
    run_modes([*GRPO_TWO_RANKS, *engine, f"run_dir={run}"], tmp_path / "run", timeout=1800)
    train = json.loads((run / "metrics.json").read_text())["train"]
    assert train["engine"]["world_size"] == 2 and len({r["pid"] for r in train["engine"]["ranks"]}) == 2
    assert train["steps"] == 2 and train["grpo"]["logged_steps"] == 2
    assert 0 < train["grpo"]["completion_mean_length"]["last"] <= 6
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    return dict(train["engine"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended
def test_grpo_under_ddp_on_two_cpu_ranks(tiny_cache: Path, tmp_path: Path) -> None:
    engine = _two_ranks(tmp_path)
    assert engine["wrapper"] == "DistributedDataParallel" and engine["backend"] == "gloo"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended
def test_grpo_under_fsdp2_on_two_cpu_ranks(tiny_cache: Path, tmp_path: Path) -> None:
    engine = _two_ranks(tmp_path, "train.sharding=fsdp", "train.engine=fsdp")
    assert engine["wrapper"].startswith("FSDP")
