"""SimPO on two CPU ranks (gloo) under DDP: TRL's CPOTrainer runs on the planned engine and trains like one process.

    pytest -m distributed tests/test_simpo_distributed.py

Driven as a user drives it (`mode=data`, then `mode=train` through the launcher), on the bundled preference
set with LoRA: 8 pairs a step on two ranks, against one process taking them as micro-batch 4 x accumulation 2.
(ZeRO-3 and FSDP2 run TRL's experimental trainers in tests/test_orpo_distributed.py: the same wrapping.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import losses, run_modes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4


def pipeline_run(root: Path, name: str, *extra: str) -> dict:
    run_dir = root / name
    args = [
        f"run_dir={run_dir}", "+recipe=tiny_simpo", "train.seq_len=64", f"train.max_steps={STEPS}",
        "train.batch_size=8", "train.logging_steps=1", "train.warmup_ratio=0.0", f"train.save_steps={STEPS}",
        "train.eval_steps=1000", f"data.cache_dir={root / 'data-cache'}", *extra,
    ]  # fmt: skip
    run_modes(args, root / name, timeout=900)
    return {
        "metrics": json.loads((run_dir / "metrics.json").read_text()),
        "losses": losses(run_dir / "checkpoints" / f"checkpoint-{STEPS}"),
    }


def test_simpo_ddp_two_processes_train_like_one(tmp_path, tiny_cache):
    one = pipeline_run(
        tmp_path,
        "one-process",
        "hardware.gpus_per_node=1",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
    )
    ddp = pipeline_run(tmp_path, "ddp", "hardware.gpus_per_node=2")
    assert len(ddp["losses"]) == len(one["losses"]) == STEPS
    assert ddp["losses"] == pytest.approx(one["losses"], rel=1e-4)
    engine = ddp["metrics"]["train"]["engine"]
    assert engine["world_size"] == 2 and engine["backend"] == "gloo"
    assert engine["wrapper"] == "DistributedDataParallel" and [r["rank"] for r in engine["ranks"]] == [0, 1]
    assert one["metrics"]["train"]["engine"]["world_size"] == 1
    assert ddp["metrics"]["train"]["simpo"]["logged_steps"] == STEPS
