"""KTO on one process and on two CPU ranks (gloo): the planned engine really runs KTO, and trains like one process.

    pytest -m distributed tests/test_kto_distributed.py          # CI: one process (and bf16), DDP
    pytest -m extended tests/test_kto_distributed.py             # the rest: ZeRO-3, FSDP2

Driven as a user drives it (`mode=data`, then `mode=train` through the launcher), on the bundled labelled set
with LoRA. Every run takes 8 examples a step; one process takes them as micro-batch 4 x accumulation 2, two
ranks as micro-batch 4 each, so every micro-batch holds the same 4 rows and TRL's KL pairs are the same. The
first step's loss is exactly 0.5 everywhere (a fresh adapter: the policy is its reference, every log-ratio and
the KL estimate 0, and 1 - sigmoid(0) = 0.5). TRL averages the KL estimate over the ranks' micro-batches of a
step (`gather_for_metrics`) where one process's accumulated micro-batches each use their own, which would part
the trajectories; in these four steps the estimate stays at TRL's clamp of 0 (DDP matched one process to six
digits), and the tolerance leaves room for a step where it does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ENGINE_RUN, ONE_PROCESS, EngineRun, assert_trains_like, run_modes, run_on_engine

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-3
KTO = ("objective=kto", *ENGINE_RUN, "method.learning_rate=1e-3")


def two_ranks(root: Path, engine: str) -> EngineRun:
    return run_on_engine(root, engine, engine, *KTO, "train.micro_batch_size=4", steps=STEPS)


def assert_like_one_process(run: EngineRun, reference: EngineRun) -> None:
    assert run.losses[0] == pytest.approx(0.5, abs=1e-6)
    assert_trains_like(run, reference, LOSS_RTOL)
    engine = run.engine
    assert engine["micro_batch_size"] == 4 and engine["grad_accum_steps"] == 1
    assert engine["loss"] == "trl"  # TRL's fused per-token log-probs; no chunked SFT loss


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("kto-distributed")


@pytest.fixture(scope="module")
def reference(root) -> EngineRun:
    run = run_on_engine(root, "one-process", "one-process", *KTO, *ONE_PROCESS, steps=STEPS)
    engine = run.engine
    assert (engine["micro_batch_size"], engine["grad_accum_steps"]) == (4, 2)
    # a fresh adapter: the policy is its reference, so every example's loss is 1 - sigmoid(0)
    assert run.losses[0] == pytest.approx(0.5, abs=1e-6)
    kto = run.metrics["train"]["kto"]
    assert kto["logged_steps"] == STEPS and kto["kl"]["first"] == 0.0 and kto["reward_margin"]["first"] == 0.0
    # the policy moved off the reference: the loss left 0.5
    assert run.losses[-1] != pytest.approx(0.5, abs=1e-4), run.losses
    return run


def test_kto_one_process_trains(reference):
    assert all(0 < x < 1 for x in reference.losses)


def test_kto_bf16_on_the_cpu_trains_and_the_eval_stage_scores_it(root):
    run = run_on_engine(root, "bf16", "one-process", *KTO, *ONE_PROCESS, "method.precision=bf16", steps=STEPS)
    t, engine = run.metrics["train"], run.engine
    assert t["precision"] == "bf16" and engine["mixed_precision"] == "bf16"
    assert engine["parameter_dtypes"] == ["bfloat16", "float32"]  # the bf16 base, fp32 adapters
    assert run.losses[0] == pytest.approx(0.5, abs=1e-3)
    run_modes([*run.args, "eval.num_samples=4", "eval.regression=false"], run.dir, modes=("eval",))
    ev = json.loads((run.dir / "metrics.json").read_text())["eval"]
    assert ev["base"]["desirable_margin"] == 0.0 and ev["base"]["separation_accuracy"] == 0.0
    assert ev["trained"]["examples"] == ev["base"]["examples"] > 0


def test_kto_ddp_two_processes_train_like_one(root, reference):
    assert_like_one_process(two_ranks(root, "ddp"), reference)


@pytest.mark.extended
def test_kto_zero3_two_processes_train_like_one(root, reference):
    assert_like_one_process(two_ranks(root, "zero3"), reference)


@pytest.mark.extended
def test_kto_fsdp2_two_processes_train_like_one(root, reference):
    assert_like_one_process(two_ranks(root, "fsdp2"), reference)
