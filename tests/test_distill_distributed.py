"""Distillation on two CPU ranks (gloo): the planned engine really runs, trains like one process, and the teacher
is prepared like the student: whole on each rank under DDP, divided over the ranks under ZeRO-3 and FSDP2.

    pytest -m distributed tests/test_distill_distributed.py            # CI: DDP against one process
    pytest -m extended tests/test_distill_distributed.py               # ZeRO-3 and FSDP2

Driven as a user drives it (`mode=data`, then `mode=train` through the launcher) on the bundled conversations:
the tiny preset (4 layers) teaches a LoRA student of half its depth. Every run takes 8 rows a step; its loss
trajectory is compared with one process taking them as micro-batch 4 x accumulation 2, and metrics.json's
`train.engine` must show the planned engine and `train.distill.teacher_share` rank 0's share of the teacher.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ENGINE_RUN, ONE_PROCESS, EngineRun, assert_trains_like, run_on_engine

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-3
DISTILL = (
    "objective=distill",
    "objective.teacher=tiny",
    "model.num_layers=2",
    *ENGINE_RUN,
    "train.seq_len=128",
)


def assert_like_one_process(root: Path, engine: str, reference: EngineRun, teacher_share: float) -> None:
    run = run_on_engine(root, engine, engine, *DISTILL, steps=STEPS)
    assert_trains_like(run, reference, LOSS_RTOL)
    # the teacher as TRL prepared it beside the student: this rank's share of its parameters
    assert run.metrics["train"]["distill"]["teacher_share"] == pytest.approx(teacher_share, abs=0.01)


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("distill-distributed")


@pytest.fixture(scope="module")
def reference(root) -> EngineRun:
    run = run_on_engine(root, "one-process", "one-process", *DISTILL, *ONE_PROCESS, steps=STEPS)
    assert run.metrics["train"]["distill"]["teacher_share"] == 1.0
    return run


def test_distill_ddp_two_processes_train_like_one(root, reference):
    assert_like_one_process(root, "ddp", reference, teacher_share=1.0)


@pytest.mark.extended
def test_distill_zero3_shards_the_teacher(root, reference):
    assert_like_one_process(root, "zero3", reference, teacher_share=0.5)


@pytest.mark.extended
def test_distill_fsdp2_shards_the_teacher(root, reference):
    assert_like_one_process(root, "fsdp2", reference, teacher_share=0.5)
