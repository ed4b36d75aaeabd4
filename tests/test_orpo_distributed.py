"""ORPO on two CPU ranks (gloo): the planned engine really runs TRL's ORPOTrainer, and trains like one process.

    pytest -m distributed tests/test_orpo_distributed.py           # CI: DDP against one process
    pytest -m extended tests/test_orpo_distributed.py              # ZeRO-3 and FSDP2

Driven as a user drives it (`mode=data`, then `mode=train` through the launcher), on the bundled preference
set with LoRA. Every run takes 8 pairs a step (16 sequences); its ORPO loss trajectory is compared with one
process taking the same 8 pairs as micro-batch 4 x accumulation 2, and the engine record (metrics.json
`train.engine`) must show the planned engine and each rank's share of the parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ENGINE_RUN, ONE_PROCESS, EngineRun, assert_trains_like, run_on_engine

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-4
ORPO = ("objective=orpo", *ENGINE_RUN)


def assert_like_one_process(root: Path, engine: str, reference: EngineRun) -> None:
    run = run_on_engine(root, engine, engine, *ORPO, steps=STEPS)
    assert_trains_like(run, reference, LOSS_RTOL)
    assert run.engine["loss"] == "trl" and run.metrics["train"]["orpo"]["logged_steps"] == STEPS


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("orpo-distributed")


@pytest.fixture(scope="module")
def reference(root) -> EngineRun:
    return run_on_engine(root, "one-process", "one-process", *ORPO, *ONE_PROCESS, steps=STEPS)


def test_orpo_ddp_two_processes_train_like_one(root, reference):
    assert_like_one_process(root, "ddp", reference)


@pytest.mark.extended
def test_orpo_zero3_two_processes_train_like_one(root, reference):
    assert_like_one_process(root, "zero3", reference)


@pytest.mark.extended
def test_orpo_fsdp2_two_processes_train_like_one(root, reference):
    assert_like_one_process(root, "fsdp2", reference)
