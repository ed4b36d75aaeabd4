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

import json
from pathlib import Path

import pytest
from helpers import losses, run_modes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-3
RUN_TIMEOUT_S = 900


def pipeline_run(root: Path, name: str, *extra: str) -> dict:
    run_dir = root / name
    args = [
        f"run_dir={run_dir}",
        "objective=distill",
        "objective.teacher=tiny",
        "model.num_layers=2",
        "hardware=cpu",
        "train.seq_len=128",
        f"train.max_steps={STEPS}",
        "train.batch_size=8",
        "train.logging_steps=1",
        "train.warmup_ratio=0.0",
        "method.lora_dropout=0.0",
        f"train.save_steps={STEPS}",
        "train.eval_steps=1000",
        "train.report_to=[]",
        f"data.cache_dir={root / 'data-cache'}",
        *extra,
    ]
    run_modes(args, root / name, timeout=RUN_TIMEOUT_S)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {"metrics": metrics, "losses": losses(run_dir / "checkpoints" / f"checkpoint-{STEPS}")}


def assert_like_one_process(run: dict, reference: dict, teacher_share: float) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))
    assert worst <= LOSS_RTOL, f"losses {run['losses']} vs one process {reference['losses']}"
    train = run["metrics"]["train"]
    engine = train["engine"]
    assert engine["world_size"] == 2 and engine["backend"] == "gloo"
    assert [r["rank"] for r in engine["ranks"]] == [0, 1]
    # the teacher as TRL prepared it beside the student: this rank's share of its parameters
    assert train["distill"]["teacher_share"] == pytest.approx(teacher_share, abs=0.01)


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("distill-distributed")


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
    assert run["metrics"]["train"]["distill"]["teacher_share"] == 1.0
    return run


def test_distill_ddp_two_processes_train_like_one(root, reference):
    run = pipeline_run(root, "ddp", "hardware.gpus_per_node=2")
    assert run["metrics"]["train"]["engine"]["wrapper"] == "DistributedDataParallel"
    assert_like_one_process(run, reference, teacher_share=1.0)


@pytest.mark.extended
def test_distill_zero3_shards_the_teacher(root, reference):
    run = pipeline_run(
        root, "zero3", "hardware.gpus_per_node=2", "train.sharding=zero3", "train.engine=zero3"
    )
    engine = run["metrics"]["train"]["engine"]
    assert engine["wrapper"] == "DeepSpeedEngine" and engine["zero_stage"] == 3
    assert_like_one_process(run, reference, teacher_share=0.5)


@pytest.mark.extended
def test_distill_fsdp2_shards_the_teacher(root, reference):
    run = pipeline_run(root, "fsdp2", "hardware.gpus_per_node=2", "train.sharding=fsdp", "train.engine=fsdp")
    assert run["metrics"]["train"]["engine"]["wrapper"].startswith("FSDP")
    assert_like_one_process(run, reference, teacher_share=0.5)
