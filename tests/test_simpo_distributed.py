"""SimPO and CPO (TRL's CPOTrainer) on the engines users meet: one process in bf16, DDP on two CPU ranks (gloo)
against one process, and ZeRO-3 and FSDP2 on two CPU ranks.

    pytest -m distributed tests/test_simpo_distributed.py      # CI: SimPO in bf16 on one process, and DDP
    pytest -m extended tests/test_simpo_distributed.py         # ZeRO-3 and FSDP2; CPO's every case

Driven as a user drives it (`mode=data`, then `mode=train` through the launcher), on the bundled preference
set with LoRA: 8 pairs a step on two ranks, against one process taking them as micro-batch 4 x accumulation 2.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ENGINE_RUN, ONE_PROCESS, EngineRun, assert_trains_like, run_modes, run_on_engine

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-4
OBJECTIVES = {
    "simpo": ("+recipe=tiny_simpo", *ENGINE_RUN),
    "cpo": ("objective=cpo", *ENGINE_RUN, "method.learning_rate=1e-3"),
}
EXTENDED = pytest.mark.extended
# CPO runs SimPO's trainer (CPOTrainer) with another loss_type: CI runs the trainer's engines through SimPO.
IN_CI = {("simpo", "ddp"), ("simpo", "one-process")}
ENGINE_MATRIX = [
    pytest.param(
        objective, engine, marks=() if (objective, engine) in IN_CI else EXTENDED, id=f"{objective}-{engine}"
    )
    for objective in OBJECTIVES
    for engine in ("ddp", "zero3", "fsdp2")
]
BF16 = [
    pytest.param(objective, marks=() if (objective, "one-process") in IN_CI else EXTENDED, id=objective)
    for objective in OBJECTIVES
]


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("simpo-distributed")


@pytest.fixture(scope="module")
def reference(root) -> Callable[[str], EngineRun]:
    """Each objective's one-process run, made once."""
    made: dict[str, EngineRun] = {}

    def one_process(objective: str) -> EngineRun:
        if objective not in made:
            args = (*OBJECTIVES[objective], *ONE_PROCESS)
            made[objective] = run_on_engine(
                root, f"{objective}-one-process", "one-process", *args, steps=STEPS
            )
        return made[objective]

    return one_process


@pytest.mark.parametrize("objective, engine", ENGINE_MATRIX)
def test_two_processes_train_like_one(objective, engine, root, reference):
    run = run_on_engine(root, f"{objective}-{engine}", engine, *OBJECTIVES[objective], steps=STEPS)
    assert_trains_like(run, reference(objective), LOSS_RTOL)
    assert run.engine["loss"] == "trl" and run.metrics["train"][objective]["logged_steps"] == STEPS


@pytest.mark.parametrize("objective", BF16)
def test_bf16_on_the_cpu_trains_and_the_eval_stage_scores_it(objective, root, reference):
    args = (*OBJECTIVES[objective], *ONE_PROCESS, "method.precision=bf16")
    run = run_on_engine(root, f"{objective}-bf16", "one-process", *args, steps=STEPS)
    t, engine = run.metrics["train"], run.engine
    assert t["precision"] == "bf16" and engine["mixed_precision"] == "bf16"
    assert engine["parameter_dtypes"] == ["bfloat16", "float32"]  # the bf16 base, fp32 adapters
    # the fp32 run's losses, to bf16's precision
    assert run.losses == pytest.approx(reference(objective).losses, rel=0.05)
    assert t[objective]["logged_steps"] == STEPS and all(math.isfinite(x) for x in run.losses)
    run_modes([*run.args, "eval.num_samples=4", "eval.regression=false"], run.dir, modes=("eval",))
    ev = json.loads((run.dir / "metrics.json").read_text())["eval"]
    for scores in (ev["base"], ev["trained"]):
        assert scores["pairs"] > 0 and 0.0 <= scores["margin_accuracy"] <= 1.0
    assert ev["trained"]["pairs"] == ev["base"]["pairs"]
