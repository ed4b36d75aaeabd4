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

from pathlib import Path

import pytest
from helpers import ENGINE_RUN, ONE_PROCESS, EngineRun, assert_trains_like, run_on_engine

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-4
REWARD = ("objective=reward", "method=lora", *ENGINE_RUN, "method.learning_rate=1e-3")


def assert_like_one_process(root: Path, engine: str, reference: EngineRun) -> EngineRun:
    run = run_on_engine(root, engine, engine, *REWARD, steps=STEPS)
    assert_trains_like(run, reference, LOSS_RTOL)
    # the score head, not an LM head: the trained adapter carries it
    trainable = run.metrics["train"]["trainable_parameters"]
    assert trainable == reference.metrics["train"]["trainable_parameters"]
    return run


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("reward-distributed")


@pytest.fixture(scope="module")
def reference(root) -> EngineRun:
    run = run_on_engine(root, "one-process", "one-process", *REWARD, *ONE_PROCESS, steps=STEPS)
    # -log sigmoid of score differences near 0: about log 2
    assert all(0 < loss < 2 for loss in run.losses)
    return run


def test_reward_ddp_two_processes_train_like_one(root, reference):
    assert_like_one_process(root, "ddp", reference)


@pytest.mark.extended
def test_reward_zero3_two_processes_train_like_one(root, reference):
    run = assert_like_one_process(root, "zero3", reference)
    assert run.engine["loaded_partitioned"]


@pytest.mark.extended
def test_reward_fsdp2_two_processes_train_like_one(root, reference):
    assert_like_one_process(root, "fsdp2", reference)
