"""DPO on two CPU ranks (gloo): the planned engine really runs DPO, and trains like one process.

    pytest -m distributed tests/test_dpo_distributed.py                   # CI: ZeRO-3 against one process
    pytest -m extended tests/test_dpo_distributed.py                 # the rest: DDP, ZeRO-3 offload, FSDP2

Driven as a user drives it (`mode=data`, then `mode=train` through the launcher), on the bundled preference
set with LoRA. Every run takes 8 pairs a step (16 sequences: chosen and rejected); its DPO loss trajectory
is compared with one process taking the same 8 pairs as micro-batch 4 x accumulation 2, and the engine
record (metrics.json `train.engine`) must show the planned engine. ZeRO-3 is the representative run: it
loads partitioned (zero.Init), and TRL's frozen "ref" copy of the adapter is made from partitioned weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ENGINE_RUN, ONE_PROCESS, EngineRun, assert_trains_like, run_modes, run_on_engine

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
LOSS_RTOL = 1e-4
DPO = ("objective=dpo", *ENGINE_RUN)
# The first ZeRO-3 offload run on a machine JIT-compiles DeepSpeed's CPU Adam and its shared-memory comm op into
# ~/.cache/torch_extensions (rebuilt whenever the op's build flags change): 13 minutes for the comm op alone on 2
# loaded cores, past the 900 s a mode gets. Later runs load the cached ops.
OFFLOAD_TIMEOUT_S = 2400


def assert_like_one_process(run: EngineRun, reference: EngineRun) -> None:
    assert_trains_like(run, reference, LOSS_RTOL)
    assert run.engine["loss"] == "trl"  # TRL's fused per-token log-probs; no chunked SFT loss


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("dpo-distributed")


@pytest.fixture(scope="module")
def reference(root) -> EngineRun:
    run = run_on_engine(root, "one-process", "one-process", *DPO, *ONE_PROCESS, steps=STEPS)
    # the first step's DPO loss is log 2: the policy starts as the reference (a fresh adapter)
    assert run.losses[0] == pytest.approx(0.6931, abs=1e-3)
    return run


def test_dpo_zero3_two_processes_train_like_one(root, reference):
    run = run_on_engine(root, "zero3", "zero3", *DPO, steps=STEPS)
    assert run.engine["loaded_partitioned"]
    assert_like_one_process(run, reference)


@pytest.mark.extended
def test_dpo_ddp_two_processes_train_like_one(root, reference):
    run = run_on_engine(root, "ddp", "ddp", *DPO, steps=STEPS)
    assert_like_one_process(run, reference)
    run_modes(run.args, run.dir, modes=("eval",))  # the eval stage scores the pairs
    ev = json.loads((run.dir / "metrics.json").read_text())["eval"]
    assert ev["base"]["preference_accuracy"] == 0.0 and "preference_accuracy" in ev["trained"]


@pytest.mark.extended
def test_dpo_zero3_offload_two_processes_train_like_one(root, reference):
    run = run_on_engine(
        root, "zero3-offload", "zero3", *DPO, "train.offload_optimizer=true", steps=STEPS,
        timeout=OFFLOAD_TIMEOUT_S,
    )  # fmt: skip
    assert run.engine["offload_optimizer"] == "cpu"
    assert_like_one_process(run, reference)


@pytest.mark.extended
def test_dpo_fsdp2_two_processes_train_like_one(root, reference):
    run = run_on_engine(root, "fsdp2", "fsdp2", *DPO, steps=STEPS)
    assert_like_one_process(run, reference)
