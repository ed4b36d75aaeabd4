"""scripts/trainer_loop_probe.py, the one probe bench_dpo_overhead times both sides with: it counts the loop's
steps between the first step's start and the last step's end, and refuses an unknown part to switch off."""

from __future__ import annotations

import pytest
from helpers import script_module


def test_the_probe_reads_the_loop_from_train_begin_to_the_last_step(monkeypatch: pytest.MonkeyPatch):
    import gc

    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler

    # the probe wraps CallbackHandler's methods and adds a gc callback: both put back after the test
    for name in ("on_train_begin", "on_step_end"):
        monkeypatch.setattr(CallbackHandler, name, getattr(CallbackHandler, name))
    monkeypatch.setattr(gc, "callbacks", list(gc.callbacks))
    probe = script_module("trainer_loop_probe").Probe()
    probe.install()
    handler = CallbackHandler([], None, None, None, None)
    args, state, control = (
        TrainingArguments(output_dir="unused", use_cpu=True),
        TrainerState(),
        TrainerControl(),
    )
    state.max_steps = 3
    handler.on_train_begin(args, state, control)
    for step in range(1, 4):
        state.global_step = step
        sum(range(20_000))  # some work on the main thread
        handler.on_step_end(args, state, control)
    state.global_step = 4  # after the last step: not counted
    handler.on_step_end(args, state, control)
    figures = probe.figures()
    assert figures["steps"] == 3
    assert figures["wall"] > 0
    assert figures["cpu"] == pytest.approx(figures["user"] + figures["system"])
    assert figures["state"]["callbacks"] == []


def test_an_unknown_part_to_switch_off_is_refused():
    with pytest.raises(SystemExit, match=r"--off: unknown part\(s\) \['nonsense'\]"):
        script_module("trainer_loop_probe").main(
            ["out.json", "--off", "nonsense", "-m", "finetune.train", "RUN_DIR"]
        )
