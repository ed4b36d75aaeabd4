"""DPO's resume and preemption, as SFT's (tests/test_resume.py, tests/test_preemption.py): a worker killed with
SIGKILL mid-run resumes to exactly the uninterrupted DPO losses and adapter, and SIGTERM saves, exits 75, and
the same command resumes. Each is a few DPO worker runs on the tiny model (start-ups of ~20 s each on two
idle cores): extended."""

from __future__ import annotations

import json
import signal

import pytest
from helpers import (
    adapter_weights,
    finish,
    losses,
    prepare_worker_run,
    sigkill_then_resume,
    wait_for_checkpoint,
    worker,
)

from finetune.rundir import checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.extended]

STEPS = 16
# DPO on the bundled pairs: 2 pairs (4 sequences) a step, a checkpoint every 4 steps
DPO_RUN = ("objective=dpo", f"train.max_steps={STEPS}", "train.save_steps=4", "train.save_total_limit=10")


def test_dpo_sigkill_at_a_random_step_then_resume_matches_uninterrupted(tmp_path, tiny_cache):
    import torch

    cache = tmp_path / "cache"
    reference = prepare_worker_run(tmp_path / "reference", cache, *DPO_RUN)
    code, err = finish(worker(reference))
    assert code == 0, err[-3000:]

    run = prepare_worker_run(tmp_path / "killed", cache, *DPO_RUN)
    sigkill_then_resume(run, 4, STEPS)

    expected = losses(reference / "checkpoints" / f"checkpoint-{STEPS}")
    assert len(expected) == STEPS and expected[0] == pytest.approx(
        0.6931, abs=1e-3
    )  # DPO's log 2 at the start
    assert losses(run / "checkpoints" / f"checkpoint-{STEPS}") == expected  # exact, every step
    ref, got = adapter_weights(reference), adapter_weights(run)
    # the same adapter, bit for bit: the eval stage scores both alike
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_dpo_sigterm_saves_exits_75_and_the_same_command_resumes(tmp_path, tiny_cache):
    run = prepare_worker_run(
        tmp_path / "run", tmp_path / "cache", *DPO_RUN, "train.max_steps=40", "train.loss_spike_factor=0"
    )
    proc = worker(run)
    wait_for_checkpoint(run, 4, proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 75, err[-3000:]
    last = checkpoints.last_complete(run / "checkpoints")
    step = checkpoints.step_of(last)
    assert 4 <= step < 40
    assert f"stopped by SIGTERM at step {step}; checkpoint saved: {last}" in err
    assert "Traceback" not in err and not (run / "metrics.json").exists()

    code, err = finish(worker(run))
    assert code == 0, err[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["train"]["resumed_from"] == str(last.resolve()) and metrics["train"]["steps"] == 40
    assert len(losses(run / "checkpoints" / "checkpoint-40")) == 40
