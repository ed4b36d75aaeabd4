"""Reward modelling on two CPU ranks (gloo): the planned engine really runs TRL's RewardTrainer, and trains like
one process.

    pytest -m distributed tests/test_reward_distributed.py        # CI: DDP against one process
    pytest -m extended tests/test_reward_distributed.py           # the rest: ZeRO-3, FSDP2

Driven as a user drives it (`mode=data`, then `mode=train` through the launcher), on the bundled preference set
with LoRA and the score head trained in full. Every run takes 8 pairs a step (16 sequences); its loss trajectory
is compared with one process taking the same 8 pairs as micro-batch 4 x accumulation 2, and the engine record
(metrics.json `train.engine`) must show the planned engine, each rank holding its share.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import losses, run_modes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-4
RUN_TIMEOUT_S = 900


def pipeline_run(root: Path, name: str, *extra: str) -> dict:
    run_dir = root / name
    args = [
        f"run_dir={run_dir}",
        "objective=reward",
        "method=lora",
        "hardware=cpu",
        "train.seq_len=64",
        f"train.max_steps={STEPS}",
        "train.batch_size=8",
        "train.logging_steps=1",
        "train.warmup_ratio=0.0",
        "method.lora_dropout=0.0",
        "method.learning_rate=1e-3",
        f"train.save_steps={STEPS}",
        "train.eval_steps=1000",
        "train.report_to=[]",
        f"data.cache_dir={root / 'data-cache'}",
        *extra,
    ]
    run_modes(args, root / name, timeout=RUN_TIMEOUT_S)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {
        "dir": run_dir,
        "args": args,
        "metrics": metrics,
        "losses": losses(run_dir / "checkpoints" / f"checkpoint-{STEPS}"),
    }


def assert_like_one_process(run: dict, reference: dict) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))
    assert worst <= LOSS_RTOL, f"reward losses {run['losses']} vs one process {reference['losses']}"
    engine = run["metrics"]["train"]["engine"]
    assert engine["world_size"] == 2 and engine["backend"] == "gloo"
    assert [r["rank"] for r in engine["ranks"]] == [0, 1]
    # the score head, not an LM head: the trained adapter carries it
    assert (
        run["metrics"]["train"]["trainable_parameters"]
        == reference["metrics"]["train"]["trainable_parameters"]
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("reward-distributed")


@pytest.fixture(scope="module")
def reference(root) -> dict:
    run = pipeline_run(
        root,
        "one-process",
        "hardware.gpus_per_node=1",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
    )
    assert run["metrics"]["train"]["engine"]["world_size"] == 1
    # -log sigmoid of score differences near 0: about log 2
    assert all(0 < loss < 2 for loss in run["losses"])
    return run


def test_reward_ddp_two_processes_train_like_one(root, reference):
    run = pipeline_run(root, "ddp", "hardware.gpus_per_node=2")
    engine = run["metrics"]["train"]["engine"]
    assert engine["wrapper"] == "DistributedDataParallel"
    # DDP: every rank holds the whole model
    assert all(r["parameters_held"] == r["parameters"] for r in engine["ranks"])
    assert_like_one_process(run, reference)


@pytest.mark.extended
def test_reward_zero3_two_processes_train_like_one(root, reference):
    run = pipeline_run(
        root, "zero3", "hardware.gpus_per_node=2", "train.sharding=zero3", "train.engine=zero3"
    )
    engine = run["metrics"]["train"]["engine"]
    assert engine["wrapper"] == "DeepSpeedEngine" and engine["zero_stage"] == 3
    assert engine["loaded_partitioned"]
    assert all(r["parameters_held"] < r["parameters"] for r in engine["ranks"])
    assert_like_one_process(run, reference)


@pytest.mark.extended
def test_reward_fsdp2_two_processes_train_like_one(root, reference):
    run = pipeline_run(root, "fsdp2", "hardware.gpus_per_node=2", "train.sharding=fsdp", "train.engine=fsdp")
    engine = run["metrics"]["train"]["engine"]
    assert engine["wrapper"].startswith("FSDP")
    assert all(r["parameters_held"] < r["parameters"] for r in engine["ranks"])
    assert_like_one_process(run, reference)
