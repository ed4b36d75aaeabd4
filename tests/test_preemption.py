"""Preemption: SIGTERM/SIGINT saves a checkpoint at the next step boundary and exits 75 with how to resume."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from finetune import checkpoints
from finetune.train import callbacks as cb
from finetune.train import stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_resume import (  # noqa: E402
    finish,
    losses,
    prepare_run_dir,
    train_run,
    wait_for_checkpoint,
    worker,
)

RUN = (
    "train.max_steps=8",
    "train.save_steps=4",
    "train.logging_steps=1",
    "train.eval_steps=1000",
    "method.lora_dropout=0.1",
)


def _run(run: Path, tiny_data, *overrides: str) -> dict:
    return train_run(run, tiny_data, (*RUN, *overrides), micro_batch_size=2, grad_accum_steps=2)


def test_sigint_saves_at_the_step_boundary_and_resumes_exactly(tmp_path, tiny_cache, tiny_data, monkeypatch):
    import torch
    from safetensors.torch import load_file

    _run(tmp_path / "reference", tiny_data)
    reference = losses(tmp_path / "reference" / "checkpoints" / "checkpoint-8")

    real = cb.RunMonitor.on_step_end

    def signal_at_step_3(self, args, state, control, **kwargs):
        real(self, args, state, control, **kwargs)
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, in the middle of the run

    monkeypatch.setattr(cb.RunMonitor, "on_step_end", signal_at_step_3)
    run = tmp_path / "run"
    with pytest.raises(stage.Preempted) as stopped:
        _run(run, tiny_data)
    assert stopped.value.exit_code == 75 == stage.PREEMPTED_EXIT_CODE
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
    m = _run(run, tiny_data)
    assert m["train"]["resumed_from"] == str((folder / "checkpoint-3").resolve()) and m["train"]["steps"] == 8
    assert losses(folder / "checkpoint-8") == reference
    a = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "reference" / "adapter" / "adapter_model.safetensors"))
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
    run = prepare_run_dir(
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
