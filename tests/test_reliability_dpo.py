"""DPO without held-out pairs (data.eval_fraction=0, or every pair's prompt the same after deduplication)
trains: the trainer evaluates nothing during training instead of failing in transformers' argument check."""

from __future__ import annotations

import json

import pytest
from helpers import prepare_run, tiny_cfg

from finetune.rundir import checkpoints


@pytest.mark.slow  # one short DPO run in this process
def test_dpo_with_no_held_out_pairs_trains(tmp_path, tiny_cache):
    from datasets import load_from_disk

    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    cfg = resolve(
        tiny_cfg(
            "objective=dpo",
            "data.eval_fraction=0",
            "train.max_steps=2",
            "train.batch_size=2",
            "train.eval_steps=1",  # an evaluation would be due every step, were there pairs to evaluate
            f"data.cache_dir={tmp_path / 'cache'}",
            run_dir=tmp_path / "run",
        )
    )
    run = prepare_run(cfg)
    assert len(load_from_disk(str(run / "data" / "eval"))) == 0
    metrics = stage.run(cfg, run, plan_stage(cfg, run, quiet=True))
    assert metrics["train"]["steps"] == 2
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    last = checkpoints.last_complete(run / "checkpoints")
    assert last is not None
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e] == [1, 2]
    assert not any("eval_loss" in e for e in history)
