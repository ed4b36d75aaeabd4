"""The training progress bar is redrawn by the loop, at most every `redraw_s`, with no thread of its own.

rich's default refresh thread redraws 10 times a second and takes the GIL from the training step; on the loaded
2-core machine it is the one thread besides the main one that uses CPU during a DPO run (BENCHMARKS.md,
"Framework overhead per step (CPU)")."""

from __future__ import annotations

import threading

from transformers import TrainerState, TrainingArguments
from transformers.trainer_callback import TrainerControl

from finetune.train.callbacks import RichProgress


def test_the_bar_starts_no_thread_and_redraws_at_most_every_redraw_s(tmp_path, monkeypatch, capsys):
    progress = RichProgress()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state, control = TrainerState(max_steps=100), TrainerControl()
    clock = [1000.0]
    monkeypatch.setattr("finetune.train.callbacks.time.monotonic", lambda: clock[0])
    before = threading.active_count()
    progress.on_train_begin(args, state, control)
    assert threading.active_count() == before
    assert progress.progress.live.auto_refresh is False

    draws: list[int] = []
    original = progress.progress.refresh
    monkeypatch.setattr(progress.progress, "refresh", lambda: (draws.append(state.global_step), original()))
    for step in range(1, 11):  # ten steps of 0.1 s: redrawn at 0.5 s and 1.0 s
        clock[0] += 0.1
        state.global_step = step
        progress.on_step_end(args, state, control)
    assert draws == [5, 10]
    # A logged loss is drawn at once, and the last step at the end, whatever the clock.
    state.global_step = 11
    progress.on_log(args, state, control, logs={"loss": 0.6931})
    state.global_step = 12
    progress.on_train_end(args, state, control)
    assert draws == [5, 10, 11, 12]
    assert progress.loss == "0.6931" and progress.progress is None
    # Not a terminal here: one bar, the final one, printed when it stops (what tests/test_distributed.py counts).
    err = capsys.readouterr().err
    assert err.count("train ━") == 1 and "12/100" in err and "loss 0.6931" in err
