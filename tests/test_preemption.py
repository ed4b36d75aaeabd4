"""Preemption: SIGTERM/SIGINT saves a checkpoint at the next step boundary and exits 75 with how to resume."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    WORKER_RUN,
    adapter_weights,
    child_env,
    finish,
    losses,
    prepare_worker_run,
    tiny_cfg,
    train_run,
    wait_for_checkpoint,
    worker,
)

from finetune.rundir import checkpoints
from finetune.train import callbacks as cb
from finetune.train import resume

# 8 steps of 2 x 2 rows, a checkpoint every 4, dropout on so the RNG state matters.
EIGHT_STEPS = ("train.max_steps=8", "train.save_steps=4", "method.lora_dropout=0.1")


def _train(run: Path, tiny_data, *overrides: str) -> dict:
    cfg = tiny_cfg(*EIGHT_STEPS, *overrides, run_dir=run)
    return train_run(cfg, tiny_data, n_eval=4, max_generate=1, micro_batch_size=2, grad_accum_steps=2)


def test_sigint_saves_at_the_step_boundary_and_resumes_exactly(tmp_path, tiny_cache, tiny_data, monkeypatch):
    import torch

    _train(tmp_path / "reference", tiny_data)
    reference = losses(tmp_path / "reference" / "checkpoints" / "checkpoint-8")

    real = cb.RunMonitor.on_step_end

    def signal_at_step_3(self, args, state, control, **kwargs):
        real(self, args, state, control, **kwargs)
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, in the middle of the run

    monkeypatch.setattr(cb.RunMonitor, "on_step_end", signal_at_step_3)
    run = tmp_path / "run"
    with pytest.raises(resume.Preempted) as stopped:
        _train(run, tiny_data)
    assert stopped.value.exit_code == 75 == resume.PREEMPTED_EXIT_CODE
    message = str(stopped.value)
    assert "stopped by SIGINT at step 3" in message and f"python -m finetune.train {run}" in message
    assert "\n" not in message
    folder = run / "checkpoints"
    assert [p.name for p in checkpoints.listing(folder)] == ["checkpoint-3"]
    assert checkpoints.verify(folder / "checkpoint-3") is None
    assert not (run / "metrics.json").exists() and not (run / "adapter").exists()
    assert signal.getsignal(signal.SIGINT) is not None and not isinstance(
        getattr(signal.getsignal(signal.SIGINT), "__self__", None), cb.Preemption
    )  # handlers restored

    monkeypatch.setattr(cb.RunMonitor, "on_step_end", real)
    m = _train(run, tiny_data)
    assert m["train"]["resumed_from"] == str((folder / "checkpoint-3").resolve()) and m["train"]["steps"] == 8
    assert losses(folder / "checkpoint-8") == reference
    a, b = adapter_weights(run), adapter_weights(tmp_path / "reference")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_repeated_signal_is_one_request_a_later_one_stops_at_once():
    p = cb.Preemption()
    p._handle(signal.SIGINT, None)
    p._handle(signal.SIGTERM, None)  # torchrun's SIGTERM right after the terminal's SIGINT: the same request
    assert p.received == "SIGINT"
    p.received_at -= p.repeat_after_s + 1
    with pytest.raises(KeyboardInterrupt):
        p._handle(signal.SIGTERM, None)


def test_early_stop_window_survives_a_resume(tmp_path):
    """A resumed run judges a loss spike against the same moving average as the uninterrupted one."""
    early = cb.EarlyStop(loss_spike_factor=3.0, eval_rise_patience=2, window=4)
    early.losses.extend([2.0, 1.5, 1.0, 0.9, 0.8])
    early.last_eval, early.rises = 0.7, 1
    (tmp_path / "trainer_state.json").write_text(
        json.dumps({"stateful_callbacks": {"EarlyStop": early.state()}})
    )
    back = cb.EarlyStop(loss_spike_factor=3.0, eval_rise_patience=2, window=4)
    back.restore(str(tmp_path))
    assert list(back.losses) == [1.5, 1.0, 0.9, 0.8] and back.losses.maxlen == 4
    assert (back.last_eval, back.rises) == (0.7, 1)


@pytest.mark.slow
def test_sigterm_to_the_worker_saves_exits_75_and_the_same_command_resumes(tmp_path, tiny_cache):
    run = prepare_worker_run(
        tmp_path / "run", tmp_path / "cache", "train.max_steps=60", "train.loss_spike_factor=0"
    )
    proc = worker(run)
    wait_for_checkpoint(run, 5, proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 75, err[-3000:]
    last = checkpoints.last_complete(run / "checkpoints")
    step = checkpoints.step_of(last)
    assert 5 <= step < 60
    assert f"stopped by SIGTERM at step {step}; checkpoint saved: {last}" in err
    assert f"To resume, run the same command again (or: python -m finetune.train {run})" in err
    assert "Traceback" not in err and not (run / "metrics.json").exists()

    code, err = finish(worker(run))
    assert code == 0, err[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["train"]["resumed_from"] == str(last.resolve()) and metrics["train"]["steps"] == 60
    assert len(losses(run / "checkpoints" / "checkpoint-60")) == 60


# ---------------------------------------------------------------- exit 75 for every interruption, a true message

# Runs the worker's entry point with one step made slow (it touches FLAG, then waits): a signal sent
# then lands in that step. argv: FLAG MODULE FUNCTION [python -m finetune.train] RUN_DIR.
SLOW_STEP = """
import importlib, sys, time
from pathlib import Path
flag, module, name = sys.argv[1:4]
mod = importlib.import_module(module)
def slow(*args, **kwargs):
    Path(flag).write_text("in")
    time.sleep(120)
setattr(mod, name, slow)
from finetune.train.__main__ import main
sys.exit(main([sys.argv[-1]]))
"""


def _wait(flag: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {flag.name} after {timeout} s"
        time.sleep(0.02)


def _slow_worker(run: Path, flag: Path, module: str, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_STEP, str(flag), module, name, str(run)],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "module, name, during",
    [
        ("finetune.modeling.loading", "load_for_training", "loading the model"),
        ("finetune.train.stage", "load_prepared", "loading the data"),
    ],
    ids=["model_load", "data_load"],
)
def test_sigterm_outside_the_training_loop_stops_at_once_with_75(tmp_path, tiny_cache, module, name, during):
    """SIGTERM while the worker loads stops it at once (exit 75, not 2, not after the slow step), with one line
    that names what it was doing and claims no checkpoint this attempt did not save."""
    run = prepare_worker_run(tmp_path / "run", tmp_path / "cache", "train.max_steps=4", "method=full")
    flag = tmp_path / "flag"
    proc = _slow_worker(run, flag, module, name)
    _wait(flag, proc)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 20  # at once, not after the 120 s step
    assert proc.returncode == 75, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("finetune.train: stopped")]
    assert len(line) == 1 and "Traceback" not in err, err[-3000:]
    assert f"stopped by SIGTERM during {during}, at once (nothing was saved by this stop)" in line[0]
    assert "no checkpoint was saved yet" in line[0] and "saved:" not in line[0]
    assert f"python -m finetune.train {run}" in line[0]
    assert not (run / "checkpoints").exists() or not checkpoints.listing(run / "checkpoints")


def _sigterm_during(run: Path, flag: Path, module: str, name: str) -> str:
    """The worker on `run`, stopped by SIGTERM inside `module.name`: its stderr, once it exited 75."""
    proc = _slow_worker(run, flag, module, name)
    _wait(flag, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    return err


def test_sigterm_while_saving_after_the_loop_names_its_final_checkpoint_and_keeps_no_half_output(
    tmp_path, tiny_cache
):
    """After the loop the output is saved whole or not at all: a SIGTERM while it is written stops at once,
    leaves no adapter/ and no metrics.json, and the line names the checkpoint the loop saved."""
    run = prepare_worker_run(tmp_path / "run", tmp_path / "cache", "train.max_steps=4", "train.save_steps=2")
    err = _sigterm_during(run, tmp_path / "flag", "finetune.modeling.outputs", "record")
    final = run / "checkpoints" / "checkpoint-4"
    assert (
        "during saving the trained output, at once (nothing was saved by this stop); the newest complete "
        f"checkpoint is {final}" in err
    ), err[-3000:]
    assert not (run / "adapter").exists() and not (run / "metrics.json").exists()


def test_sigterm_before_training_names_the_existing_resume_point_not_a_new_save(tmp_path, tiny_cache):
    run = prepare_worker_run(
        tmp_path / "run", tmp_path / "cache", "train.max_steps=4", "train.save_steps=2", "method=full"
    )
    code, err = finish(worker(run))
    assert code == 0, err[-3000:]
    (run / "metrics.json").unlink()  # as if the run had died after its last checkpoint
    newest = checkpoints.last_complete(run / "checkpoints")
    stamp = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    err = _sigterm_during(run, tmp_path / "flag", "finetune.modeling.loading", "load_for_training")
    assert (
        f"during loading the model, at once (nothing was saved by this stop); the newest complete checkpoint is {newest}"
        in err
    )
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == stamp


def _fake_python(tmp_path: Path, module: str, name: str, flag: Path) -> Path:
    """launch.python for the pipeline: the worker with one step made slow."""
    fake = tmp_path / "slowpy"
    fake.write_text(
        f'#!/usr/bin/env bash\nexec {sys.executable} -c {shlex.quote(SLOW_STEP)} {flag} {module} {name} "$@"\n'
    )
    fake.chmod(0o755)
    return fake


def test_two_sigterms_to_the_pipeline_half_a_second_apart_exit_75(tmp_path, tiny_cache):
    """SIGTERM twice (0.5 s apart) to `python -m finetune mode=train` during model load exits 75 (interrupted),
    not 2 (reserved for bad input), in one line and no traceback."""
    run = prepare_worker_run(tmp_path / "run", tmp_path / "cache", "train.max_steps=4")
    flag = tmp_path / "flag"
    fake = _fake_python(tmp_path, "finetune.modeling.loading", "load_for_training", flag)
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune", "mode=train", f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}",
         *WORKER_RUN, f"launch.python={fake}"],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait(flag, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "exited with code" not in err
    assert "finetune.train: stopped by SIGTERM during loading the model, at once" in err
    assert "finetune: training was stopped by a signal (what it saved is said above)" in err


def test_sigterm_to_the_pipeline_during_the_data_stage_exits_75(tmp_path, tiny_cache):
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom finetune.data import conversations\n"
        "def slow(*a, **k):\n    Path(sys.argv[1]).write_text('in')\n    time.sleep(120)\n"
        "conversations.prepare = slow\nfrom finetune.pipeline.cli import main\nsys.exit(main(sys.argv[2:]))\n"
    )
    flag, run = tmp_path / "flag", tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(flag), "mode=data", f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}"],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait(flag, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("finetune:")]
    assert len(lines) == 1 and lines[0].startswith("finetune: stopped by SIGTERM during the data stage;")
    assert "Traceback" not in err and not (run / "data").exists()
    assert list((tmp_path / "cache").rglob("stats.json")) == []  # no cache entry, half-built or not
