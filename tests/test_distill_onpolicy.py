"""On-policy and sequence-level distillation: the settings (`objective.lmbda`, `objective.seq_kd`,
`objective.max_completion_length`) and their one-line refusals, the prompts the collator hands TRL's sampling,
a CPU run in which the student and the teacher really sampled, and the rollout the plan counts when the step
generates (and not when it does not)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from helpers import last_losses, planned_run_dir, run_cli, tiny_cfg, train_run, write_engine

from finetune.core.errors import ConfigError
from finetune.modeling.collator import IGNORE_INDEX
from finetune.planner.rollout import kv_bytes_per_token

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
        # beside the step, the KV cache of one micro-batch's samples (a round a micro-batch): before the data
        # stage ran, prompt + completion fill train.seq_len (the 2-layer student's, or the 4-layer teacher's)
        layers = 2 if name == "on" else 4
        kv = micro * 128 * kv_bytes_per_token(replace(tiny_cfg().model, num_layers=layers))
        assert world == 1 and rollout["train_peak_bytes"] == pytest.approx(
            plan["gpu_memory_gb"]["total"] * 1e9 + kv, abs=0.6e6
        )  # plan.json's total is rounded to the MB
        assert "rollout: transformers' generation inside the trainer" in proc.stdout


def test_under_zero3_the_plan_counts_the_whole_teacher_each_rank_gathers_to_sample(tmp_path):
    """Sequence-level distillation samples from the teacher inside GKDTrainer through TRL's
    `unwrap_model_for_generation`, which under ZeRO-3 gathers every weight of the model it unwraps: the 70B
    teacher's 141,107,412,992 bf16 bytes, of which its sharded term holds 1/8 on each of 8 H100s. That does not
    fit; the plan says so, with FSDP2 (a layer at a time) as the way out, which fits."""
    from finetune import rundir
    from finetune.core.composition import compose
    from finetune.pipeline.stages import plan_stage, resolve

    def plan_on(engine: str):  # type: ignore[no-untyped-def]
        cfg = resolve(
            compose(
                [
                    "+recipe=llama8b_distill", "objective.seq_kd=true", "hardware=h100x8",
                    f"train.sharding={engine}", f"train.engine={engine}", f"run_dir={tmp_path / engine}",
                ]
            )
        )  # fmt: skip
        run_dir = rundir.prepare(cfg)
        rundir.save_config(cfg, run_dir)
        plan = plan_stage(cfg, run_dir, quiet=True)
        return plan, json.loads((run_dir / rundir.ROLLOUT_FILE).read_text())

    plan, rollout = plan_on("zero3")
    teacher_whole = 2 * 70_553_706_496
    assert "gathers the whole model on each rank to generate (+123.5 GB)" in rollout["reason"]
    assert rollout["train_peak_bytes"] > plan.gpu_memory.total * 1e9 + teacher_whole * 7 / 8
    assert not plan.fits and plan.reasons[0].startswith("rollout does not fit")
    assert (
        plan.suggestions[0]
        == "train.engine=fsdp (FSDP2 gathers a layer at a time), or a shorter max_completion_length"
    )
    plan, rollout = plan_on("fsdp")
    assert plan.fits and rollout["fits"] and "gathers" not in rollout["reason"]


def measured_generating_step(cfg, plan, run_dir, rows: int, prompt: int, answer: int) -> tuple[float, int]:
    """One training step of the real trainer in which the student samples (lmbda=1): the bytes held before it
    (the student's weights, gradients and Adam's moments, the teacher's weights) plus the peak of what the step
    allocates (scripts/bench_planner.py's `LiveBytes`: the sampling, its KV cache, the student's and the teacher's
    forwards on the sampled rows, the divergence and the backward), and the width of the rows it trained on."""
    import torch
    from datasets import Dataset
    from helpers import script_module

    from finetune.modeling import loading, models
    from finetune.train.base_trainer import build_trainer

    bench = script_module("bench_planner")
    torch.manual_seed(0)
    model, dtype = loading.load_for_training(cfg, sharded=False)
    g = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(rows):
        ids = torch.randint(5, 500, (prompt + answer,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    tokenizer = models.load_tokenizer(cfg.model)
    trainer = build_trainer(
        cfg, plan, run_dir, model, tokenizer, Dataset.from_list(examples), None, dtype, []
    )
    model, teacher = trainer.model, trainer.teacher_model
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False)
    for p in trainable:  # the state of a step in progress: gradients and Adam's moments held
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)
    held = bench.storage_bytes(
        [*model.parameters(), *(p.grad for p in trainable), *bench.optimizer_state_tensors(opt)]
        + [*model.buffers(), *teacher.parameters(), *teacher.buffers()]
    )
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before its steps
    # the training loop's forward runs under the accelerator's autocast (bf16 on fp32 weights)
    with bench.LiveBytes() as live, trainer.accelerator.autocast():
        trainer.training_step(model, batch)
    assert trainer.generated == {"student": rows, "teacher": 0}
    return held + live.peak, int(batch["input_ids"].shape[1])


@pytest.mark.slow  # builds the tiny student and teacher and samples: ~30 s on 2 loaded cores
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sampling_step_is_planned_within_5_percent(tmp_path, tiny_cache, precision):
    """The plan of a step on sampled rows (prompt + max_completion_length wide, the rows TRL's GKDTrainer forms,
    with the teacher beside the student and the sampling's KV cache, the rollout's term) against the bytes
    the real step allocates on the CPU."""
    from finetune.modeling import companions
    from finetune.planner import tensors_gb
    from finetune.planner.job import make_job, runtime

    rows, prompt, answer, completion = 8, 24, 8, 16
    width = prompt + completion
    cfg, plan, run_dir = planned_run_dir(
        tmp_path, "+recipe=tiny_distill_onpolicy", "objective.lmbda=1", f"method.precision={precision}",
        f"objective.max_completion_length={completion}", f"train.seq_len={width}",
    )  # fmt: skip
    plan = replace(plan, strategy=replace(plan.strategy, micro_batch_size=rows, grad_accum_steps=1))
    write_engine(cfg, plan, run_dir)
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, width, objective=cfg.objective.spec)
    job = replace(job, companions=companions.shapes(cfg))
    # allocated bytes (what LiveBytes counts), not the resident pages of a run's peak RSS
    rt = replace(runtime(job, plan.strategy), resident=False)
    kv = rows * width * kv_bytes_per_token(cfg.model)
    measured, trained_width = measured_generating_step(cfg, plan, run_dir, rows, prompt, answer)
    assert trained_width == width  # random tokens: no sample stops before max_completion_length
    planned = tensors_gb(job, plan.strategy, rt) * 1e9 + kv
    assert planned == pytest.approx(measured, rel=0.05)
