"""The CPU plan of a distillation run against what TRL's GKDTrainer really holds: `+recipe=tiny_distill` (the tiny
preset, 4 layers, teaching a 2-layer student; fp32, full fine-tuning, 4 packed rows of 256 tokens) run for a few
steps as a user runs it (mode=data, then mode=train), metrics.json's peak (the training process's VmHWM) against
the plan's total, the teacher's term (`companion:teacher`: its weights and the larger of its forward and the
logits comparison) included (finetune/planner/MEMORY_MODEL.md, "Companion models and distillation").
"""

from __future__ import annotations

import json

import pytest
from helpers import run_modes

STEPS = 4


# Measured (the worker's VmHWM, mlflow and wandb installed as CI installs them, transformers 5.25): 0.742 GB
# against 0.733 planned (the plan 1.3% under). Before the plan counted the worker's imports of those libraries (memory.library_imports,
# 0.056 GB) it planned 0.705 against 0.747 (5.6% under).
@pytest.mark.slow  # a data stage and a worker of 4 steps: about a minute on two shared cores
def test_tiny_distill_peak_is_planned(tmp_path, tiny_cache):
    run_dir = tmp_path / "distill"
    args = [
        "+recipe=tiny_distill", f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'data-cache'}",
        f"train.max_steps={STEPS}", "train.save_steps=1000", "train.eval_steps=1000", "train.report_to=[]",
    ]  # fmt: skip
    run_modes(args, tmp_path / "distill", timeout=900)
    train = json.loads((run_dir / "metrics.json").read_text())["train"]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert train["steps"] == STEPS and train["peak_memory_source"] == "process_peak_rss"
    memory = plan["gpu_memory_gb"]
    assert memory["companion:teacher"] > 0 and plan["strategy"]["micro_batch_size"] == 4
    planned, measured = memory["total"], train["peak_memory_gb"]
    assert measured == pytest.approx(planned, rel=0.05), (planned, measured)
