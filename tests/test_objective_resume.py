"""A resumed run of each objective ends where the uninterrupted one ends.

The offline objectives (pairs, a score head, a teacher): a worker killed with SIGKILL at a random step after its
first checkpoint, then started again with the same command, logs the uninterrupted run's losses exactly, every
step, and saves the same adapter bit for bit (as tests/test_dpo_resume.py shows for DPO and tests/test_resume.py
for SFT). Dropout is on, so the restored RNG state matters.

The objectives that sample (GRPO, RLOO): a copy of a run's directory as a run killed after step 3 leaves it
(checkpoint-2 complete, nothing after) resumes from checkpoint-2; a reward that records every completion it
scores shows the resumed steps 3 and 4 sampled the same completions, token for token (the generation RNG
restored), and the adapters end equal. RLOO's beta = 0.05: the reference adapter TRL keeps beside the policy is
rebuilt from the starting adapter, not from the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    COMPLETIONS_LOG_ENV,
    adapter_weights,
    finish,
    losses,
    prepare_run,
    prepare_worker_run,
    sigkill_then_resume,
    tiny_cfg,
    worker,
)

pytestmark = pytest.mark.slow

STEPS = 16
# A checkpoint every 4 steps of 2 examples, each objective on its own data (pairs or conversations).
OFFLINE = {
    "orpo": ("objective=orpo",),
    "simpo": ("objective=simpo",),
    "reward": ("objective=reward", "method=lora"),
    "distill": ("objective=distill", "objective.teacher=tiny", "model.num_layers=2"),
}
# The reward model (a score head beside the adapters) runs in CI; the others repeat its path with another loss.
OFFLINE_CASES = [
    pytest.param(name, marks=() if name == "reward" else pytest.mark.extended, id=name) for name in OFFLINE
]


def _same_adapter(a: Path, b: Path) -> None:
    import torch

    ref, got = adapter_weights(a), adapter_weights(b)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.parametrize("objective", OFFLINE_CASES)
def test_sigkill_at_a_random_step_then_resume_matches_uninterrupted(objective, tmp_path, tiny_cache):
    settings = (
        *OFFLINE[objective],
        f"train.max_steps={STEPS}",
        "train.save_steps=4",
        "train.save_total_limit=10",
        # two pairs a step make a noisy loss: no stop on a spike, which would end both runs before the last step
        "train.loss_spike_factor=0",
    )
    cache = tmp_path / "cache"
    reference = prepare_worker_run(tmp_path / "reference", cache, *settings)
    code, err = finish(worker(reference))
    assert code == 0, err[-3000:]

    run = prepare_worker_run(tmp_path / "killed", cache, *settings)
    sigkill_then_resume(run, 4, STEPS)

    expected = losses(reference / "checkpoints" / f"checkpoint-{STEPS}")
    assert len(expected) == STEPS and len(set(expected)) > 1
    assert losses(run / "checkpoints" / f"checkpoint-{STEPS}") == expected  # exact, every step
    # the same adapter, bit for bit: the eval stage scores both alike
    _same_adapter(reference, run)


def _rollout_settings(objective: str) -> tuple[str, ...]:
    return (
        f"objective={objective}",
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


def _train(run: Path, settings: tuple[str, ...], log: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    from finetune import rundir
    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    monkeypatch.setenv(COMPLETIONS_LOG_ENV, str(log))
    cfg = resolve(tiny_cfg(*settings, run_dir=run))
    rundir.save_config(cfg, run)
    plan = rundir.load_plan(run) if (run / rundir.PLAN_FILE).is_file() else plan_stage(cfg, run, quiet=True)
    return stage.run(cfg, run, plan)


@pytest.mark.extended  # two 4-step runs of each on the shared 2 cores: minutes
@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_resumed_rollouts_sample_what_the_uninterrupted_run_sampled(
    objective: str, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from finetune.pipeline.stages import resolve

    settings = _rollout_settings(objective)
    whole = tmp_path / "whole"
    prepare_run(resolve(tiny_cfg(*settings, run_dir=whole)))
    _train(whole, settings, tmp_path / "whole.jsonl", monkeypatch)
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
    metrics = _train(resumed, settings, tmp_path / "resumed.jsonl", monkeypatch)
    assert metrics["train"]["resumed_from"].endswith("checkpoint-2") and metrics["train"]["steps"] == 4
    again = [json.loads(x) for x in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    # steps 3 and 4 only, each completion as the uninterrupted run sampled it
    assert again == sampled[8:]
    assert len(set(sampled)) > 1  # sampling, not one repeated string
    _same_adapter(whole, resumed)
