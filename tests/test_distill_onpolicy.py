"""On-policy and sequence-level distillation: the settings (`objective.lmbda`, `objective.seq_kd`,
`objective.max_completion_length`) and their one-line refusals, the prompts the collator hands TRL's sampling,
a CPU run in which the student and the teacher really sampled, and the rollout the plan counts when the step
generates (and not when it does not)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import last_losses, planned_run_dir, run_cli, tiny_cfg, train_run, write_engine

from finetune.core.errors import ConfigError
from finetune.modeling.collator import IGNORE_INDEX

STUDENT = ("objective=distill", "objective.teacher=tiny", "model.num_layers=2", "method=full")


def test_settings_reach_trls_config(tmp_path):
    import torch

    from finetune.train.distill_trainer import build_config

    cfg, plan, run_dir = planned_run_dir(
        tmp_path, *STUDENT, "objective.lmbda=0.5", "objective.seq_kd=true",
        "objective.max_completion_length=12", "objective.temperature=0.7",
    )  # fmt: skip
    assert cfg.objective.generates
    write_engine(cfg, plan, run_dir)
    args = build_config(cfg, plan, run_dir, torch.float32)
    assert (args.lmbda, args.seq_kd, args.max_new_tokens, args.temperature) == (0.5, True, 12, 0.7)
    off = tiny_cfg(*STUDENT)
    assert (off.objective.lmbda, off.objective.seq_kd, off.objective.generates) == (0.0, False, False)


@pytest.mark.parametrize(
    "override, message",
    [
        ("objective.lmbda=1.5", "objective.lmbda=1.5: must lie in [0, 1] (the share of micro-batches the student samples)"),
        ("objective.lmbda=-0.1", "objective.lmbda=-0.1: must lie in [0, 1]"),
        ("objective.max_completion_length=0", "objective.max_completion_length=0 must be > 0"),
    ],
)  # fmt: skip
def test_bad_generation_settings_are_one_line_exit_2(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        tiny_cfg(*STUDENT, override)
    assert message in str(err.value) and "\n" not in str(err.value)
    proc = run_cli(*STUDENT, override, "mode=plan", f"run_dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"finetune: error: {message}")
    assert not (tmp_path / "r" / "plan.json").exists()


def test_the_collator_hands_each_conversations_prompt_left_padded():
    """Two conversations packed in one row and one alone: three prompts, each the tokens before its first
    labelled token, right-aligned with their attention mask."""
    from finetune.train.distill_trainer import PromptCollator

    x = IGNORE_INDEX
    packed = {
        "input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13],
        "labels": [x, x, 7, 8, x, x, x, 12, 13],
        "position_ids": [0, 1, 2, 3, 0, 1, 2, 3, 4],
    }
    alone = {"input_ids": [20, 21, 22, 23], "labels": [x, x, x, 23]}
    batch = PromptCollator(pad_token_id=0)([packed, alone])
    assert batch["prompts"].tolist() == [[0, 5, 6], [9, 10, 11], [20, 21, 22]]
    assert batch["prompt_attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1], [1, 1, 1]]
    # the packed batch itself is the one the off-policy micro-batches train on
    assert batch["input_ids"].shape == (2, 9) and batch["position_ids"][1].tolist()[:4] == [0, 1, 2, 3]


@pytest.mark.slow  # four steps that sample 8-token answers, then the evaluation: about 40 s on 2 shared cores
def test_the_student_and_the_teacher_sample_inside_the_step(tmp_path, tiny_data):
    """lmbda=0.5 with seq_kd, one process: every micro-batch samples, the student's in about half of them, the
    teacher's in the rest (TRL's `random() <= lmbda`, seeded), and the losses on those rows are finite."""
    cfg = tiny_cfg(
        *STUDENT, "objective.lmbda=0.5", "objective.seq_kd=true", "objective.max_completion_length=8",
        "objective.beta=0", "method.learning_rate=3e-3", "train.max_steps=4", "train.save_steps=1000",
        "train.warmup_ratio=0.0", "train.logging_steps=1", run_dir=tmp_path / "run",
    )  # fmt: skip
    train, evals = tiny_data
    metrics = train_run(
        cfg, (train.select(range(8)), evals), n_eval=8, max_generate=2, micro_batch_size=2, grad_accum_steps=1
    )
    steps = last_losses(tmp_path / "run")
    assert len(steps) == 4 and all(math.isfinite(x) for x in steps), steps
    kept = metrics["train"]["distill"]
    # each micro-batch of 2 packed rows holds several conversations, each sampled once
    student, teacher = kept["generated_by_student"], kept["generated_by_teacher"]
    assert student > 0 and teacher > 0, kept
    assert student + teacher >= 4 * 2, kept
    assert kept["teacher_share"] == 1.0
    assert math.isfinite(metrics["eval"]["trained"]["teacher_kl"])


def test_the_plan_counts_the_rollout_only_where_the_step_generates(tmp_path):
    """mode=plan writes rollout.json (transformers' generation inside the trainer, its KV cache on the training
    side) for lmbda > 0 or seq_kd, and none for the off-policy default."""
    for name, extra in (("on", ("objective.lmbda=0.5",)), ("seq", ("objective.seq_kd=true",)), ("off", ())):
        run = tmp_path / name
        proc = run_cli(
            *STUDENT, *extra, "objective.max_completion_length=16", "hardware=cpu", "train.seq_len=128",
            "mode=plan", f"run_dir={run}",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        if name == "off":
            assert not (run / "rollout.json").exists()
            continue
        rollout = json.loads((run / "rollout.json").read_text())
        plan = json.loads((run / "plan.json").read_text())
        assert rollout["mode"] == "transformers" and rollout["fits"], rollout
        micro, world = plan["strategy"]["micro_batch_size"], plan["layout"]["world_size"]
        # the KV cache of a micro-batch's samples (prompt + completion, fp32 keys and values) beside the step
        assert rollout["train_peak_bytes"] > plan["gpu_memory_gb"]["total"] * 1e9
        assert micro >= 1 and world == 1
        assert "rollout: transformers' generation inside the trainer" in proc.stdout
