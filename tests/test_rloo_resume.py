"""RLOO resumed from a checkpoint samples what the uninterrupted run sampled and ends with its adapter.

One run trains 4 steps with a checkpoint every 2; a copy of its run directory as a run killed after step 3
leaves it (checkpoint-2 complete, nothing after) trains again and resumes from checkpoint-2. A reward that
records every completion it scores shows the resumed steps 3 and 4 sampled the same completions, token for
token (the generation RNG restored), and the adapters end equal. beta = 0.05: the reference adapter TRL keeps
beside the policy is rebuilt from the starting adapter, not from the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import COMPLETIONS_LOG_ENV, adapter_weights, prepare_run, tiny_cfg

RLOO_RESUME = (
    "objective=rloo",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=1",
    "objective.num_generations=4",
    "objective.max_completion_length=6",
    "objective.rewards=[exact_match,helpers.record_completions]",
    "method.precision=bf16",
    "train.max_steps=4",
    "train.save_steps=2",
    "train.save_total_limit=4",
    "train.logging_steps=1",
)


def _train(run: Path, log: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    from finetune import rundir
    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    monkeypatch.setenv(COMPLETIONS_LOG_ENV, str(log))
    cfg = resolve(tiny_cfg(*RLOO_RESUME, run_dir=run))
    rundir.save_config(cfg, run)
    plan = rundir.load_plan(run) if (run / rundir.PLAN_FILE).is_file() else plan_stage(cfg, run, quiet=True)
    return stage.run(cfg, run, plan)


@pytest.mark.slow
@pytest.mark.extended  # two 4-step RLOO runs: minutes on the shared 2 cores
def test_resumed_rloo_ends_with_the_uninterrupted_run_s_adapter(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from finetune.pipeline.stages import resolve

    whole = tmp_path / "whole"
    prepare_run(resolve(tiny_cfg(*RLOO_RESUME, run_dir=whole)))
    _train(whole, tmp_path / "whole.jsonl", monkeypatch)
    sampled = [json.loads(x) for x in (tmp_path / "whole.jsonl").read_text().splitlines()]
    assert len(sampled) == 16  # 4 steps x 4 completions

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed, symlinks=True)
    for name in ("checkpoints/checkpoint-4", "adapter", "metrics.json", "eval"):
        path = resumed / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    metrics = _train(resumed, tmp_path / "resumed.jsonl", monkeypatch)
    assert metrics["train"]["resumed_from"].endswith("checkpoint-2") and metrics["train"]["steps"] == 4
    again = [json.loads(x) for x in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert again == sampled[8:]  # steps 3 and 4 only, as the uninterrupted run sampled them
    assert len(set(sampled)) > 1
    ref, got = adapter_weights(whole), adapter_weights(resumed)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
