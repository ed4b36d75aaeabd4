"""Resume: a worker killed with SIGKILL mid-run resumes to exactly the uninterrupted result (CPU, one thread)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import (
    adapter_weights,
    finish,
    losses,
    prepare_worker_run,
    sigkill_then_resume,
    tiny_cfg,
    train_run,
    worker,
)

from finetune import rundir
from finetune.core.errors import ConfigError
from finetune.rundir import checkpoints


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_matches_uninterrupted(tmp_path, tiny_cache):
    import torch

    cache = tmp_path / "cache"
    reference = prepare_worker_run(tmp_path / "reference", cache)
    code, err = finish(worker(reference))
    assert code == 0, err[-3000:]

    run = prepare_worker_run(tmp_path / "killed", cache)
    sigkill_then_resume(run, 5, 40)

    expected = losses(reference / "checkpoints" / "checkpoint-40")
    assert len(expected) == 40
    assert losses(run / "checkpoints" / "checkpoint-40") == expected  # exact, every step
    ref, got = adapter_weights(reference), adapter_weights(run)
    # the same adapter, bit for bit: the eval stage scores both alike
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


# ---------------------------------------------------------------- resume=false, resume=PATH, a changed config


# 8 steps, a checkpoint every 2, all 4 kept.
IN_PROCESS = ("train.max_steps=8", "train.save_steps=2", "train.save_total_limit=4")


def _train(run: Path, tiny_data, *overrides: str) -> dict:
    """The tiny LoRA in this process with the resume tests' settings (2 x 1 rows, 4 eval rows, one generation)."""
    cfg = tiny_cfg(*overrides, run_dir=run)
    return train_run(cfg, tiny_data, n_eval=4, max_generate=1, micro_batch_size=2, grad_accum_steps=1)


def _in_process(run: Path, tiny_data, *overrides: str) -> dict:
    return _train(run, tiny_data, *IN_PROCESS, *overrides)


def test_resume_false_starts_fresh_and_resume_path_picks_one(tmp_path, tiny_cache, tiny_data):
    run = tmp_path / "run"
    first = _in_process(run, tiny_data)
    folder = run / "checkpoints"
    reference = losses(folder / "checkpoint-8")
    assert [p.name for p in checkpoints.listing(folder)] == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]

    # resume=true with everything done: resumes at step 8, trains nothing more (transformers alone would
    # train a ninth step and rewrite the adapter), keeps the finished run's metrics.
    adapter_before = adapter_weights(run)
    again = _in_process(run, tiny_data)
    assert again["train"]["resumed_from"] == str((folder / "checkpoint-8").resolve())
    assert again["train"]["already_complete"] is True and first["train"]["already_complete"] is False
    assert again["train"]["steps"] == 8 and again["eval"] == first["eval"]
    assert [p.name for p in checkpoints.listing(folder)] == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]
    assert json.loads((run / "metrics.json").read_text())["train"]["already_complete"] is True
    assert adapter_weights(run).keys() == adapter_before.keys()
    assert all(adapter_weights(run)[k].equal(adapter_before[k]) for k in adapter_before)

    # resume=PATH: that checkpoint; the later ones are set aside (never resumed by mistake), then rewritten.
    picked = _in_process(run, tiny_data, "resume=checkpoint-4")
    assert picked["train"]["resumed_from"] == str((folder / "checkpoint-4").resolve())
    assert (folder / "superseded-checkpoint-8").is_dir() and (folder / "superseded-checkpoint-6").is_dir()
    assert losses(folder / "checkpoint-8") == reference

    # resume=false: the old checkpoints go, training starts at step 0 with the same result.
    fresh = _in_process(run, tiny_data, "resume=false")
    assert fresh["train"]["resumed_from"] is None and first["train"]["resumed_from"] is None
    assert losses(folder / "checkpoint-8") == reference
    assert [p.name for p in checkpoints.listing(folder)] == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]


def test_a_changed_config_does_not_overwrite_a_run_with_checkpoints(tmp_path):
    from finetune.pipeline.cli import compose

    run = tmp_path / "run"
    cfg = compose([f"run_dir={run}"])
    rundir.prepare(cfg)
    rundir.save_config(cfg, run)
    (run / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    before = (run / "config.yaml").read_text()
    rundir.check_resumable(compose([f"run_dir={run}", "train.max_steps=800"]), run)  # a longer run: fine
    with pytest.raises(
        ConfigError, match=r"has checkpoints trained with method.lora_rank=32, not 8.*resume=false"
    ):
        rundir.check_resumable(compose([f"run_dir={run}", "method.lora_rank=8"]), run)
    assert "lora_rank: 32" in (run / "config.yaml").read_text() and before != ""
    rundir.check_resumable(compose([f"run_dir={run}", "method.lora_rank=8", "resume=false"]), run)
    rundir.save_config(compose([f"run_dir={run}", "method.lora_rank=8", "resume=false"]), run)
    assert "lora_rank: 8" in (run / "config.yaml").read_text()


def test_an_epoch_based_run_run_again_trains_nothing(tmp_path, tiny_cache, tiny_data):
    """By epochs, the schedule's length is the trainer's own count of optimizer steps."""
    run = tmp_path / "run"
    overrides = ("train.max_steps=-1", "train.epochs=0.02", "train.save_steps=1000", "train.eval_steps=1000")
    first = _train(run, tiny_data, *overrides)
    steps = first["train"]["steps"]
    assert steps == math.ceil(0.02 * math.ceil(len(tiny_data[0]) / 2)) > 1  # 2% of an epoch of 2-row batches
    last = run / "checkpoints" / f"checkpoint-{steps}"  # transformers saves at the end of the schedule
    assert last.is_dir()
    again = _train(run, tiny_data, *overrides)
    assert again["train"]["already_complete"] is True and again["train"]["steps"] == steps
    assert again["train"]["resumed_from"] == str(last.resolve())
    assert [p.name for p in checkpoints.listing(run / "checkpoints")] == [last.name]
