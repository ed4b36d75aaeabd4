"""Distillation as an objective: its settings and their one-line refusals, the teacher resolved as `model=` names
a model, its plan term, and training on the CPU (one process) with the student's agreement with the teacher
scored for base and trained."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import last_losses, run_cli, tiny_cfg, train_run

from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES
from finetune.modeling import companions

# The student: the tiny model at half its depth (its tokenizer); the teacher: the tiny preset (4 layers).
STUDENT = ("objective=distill", "objective.teacher=tiny", "model.num_layers=2", "method=full")


def test_settings_compose_and_name_the_teacher():
    cfg = tiny_cfg(*STUDENT, "objective.beta=0", "objective.temperature=2")
    assert cfg.objective.spec is OBJECTIVES["distill"]
    assert (cfg.objective.teacher, cfg.objective.beta, cfg.objective.temperature) == ("tiny", 0.0, 2.0)
    (teacher,) = companions.resolve_all(cfg)
    assert teacher.companion.role == "teacher" and teacher.companion.head == "lm"
    assert teacher.model.num_layers == 4 and teacher.model.vocab_size == cfg.model.vocab_size


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("objective=distill",), "objective.teacher is not set: name the teacher as model= names a model"),
        (("objective=distill", "objective.teacher=tiny", "objective.beta=1.5"), "objective.beta=1.5: must lie in [0, 1]"),
        (("objective=distill", "objective.teacher=tiny", "objective.temperature=0"), "objective.temperature=0.0 must be > 0"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        tiny_cfg(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "teacher, message",
    [
        # another tokenizer: SmolLM2's 49,152 tokens against the tiny model's 512
        (
            "smollm2_135m",
            "objective.teacher=smollm2_135m: its vocabulary has 49,152 tokens, the student's (tiny) 512: "
            "the teacher must share the student's tokenizer",
        ),
        ("./no/such/teacher", "objective.teacher=./no/such/teacher: no such folder"),
        (
            "nonesuch",
            "objective.teacher=nonesuch: not a preset (configs/model/), a folder with a config.json",
        ),
    ],
)
def test_a_teacher_that_cannot_teach_is_refused_in_one_line_exit_2(tmp_path, teacher, message):
    proc = run_cli(
        "objective=distill", f"objective.teacher={teacher}", "mode=plan", f"run_dir={tmp_path / 'r'}"
    )
    assert proc.returncode == 2
    # one error line (a GGUF preset's first use may note its one-time conversion on the line before)
    errors = [line for line in proc.stderr.strip().splitlines() if line.startswith("finetune: error")]
    assert len(errors) == 1 and errors[0].startswith(f"finetune: error: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r" / "plan.json").exists()


def test_a_run_directory_is_a_teacher_once_it_holds_a_model(tmp_path, tiny_model_dir):
    run = tmp_path / "teacher-run"
    run.mkdir()
    (run / "config.yaml").write_text("name: teacher\n")
    cfg = tiny_cfg(*STUDENT[:1], f"objective.teacher={run}")
    with pytest.raises(ConfigError, match=r"holds no model/ or export/merged/ .*run its mode=export first"):
        companions.resolve_all(cfg)
    merged = run / "export" / "merged"
    merged.mkdir(parents=True)
    for item in Path(tiny_model_dir).iterdir():
        (merged / item.name).symlink_to(item)
    (teacher,) = companions.resolve_all(cfg)
    assert teacher.source == str(merged) and teacher.model.num_layers == 4


def test_the_plan_counts_the_teacher(tmp_path):
    from helpers import planned

    from finetune.planner.companions import comparison_peak

    cfg, plan = planned(*STUDENT, "hardware=cpu", "train.seq_len=128")
    (shape,) = companions.shapes(cfg)
    terms = dict(plan.gpu_memory.companions)
    # the teacher's 4 fp32 layers, not the student's 2: the teacher's own shape is planned
    assert set(terms) == {"companion:teacher"} and shape.model.num_layers == 4
    # its fp32 weights; its forward stays under the divergence's peak, which is the loss's term (both logits and
    # the divergence's copies of them, 128 tokens a row)
    assert terms["companion:teacher"] * 1e9 == pytest.approx(4 * shape.params)
    rows = plan.strategy.micro_batch_size
    assert plan.gpu_memory.logits * 1e9 == pytest.approx(comparison_peak(shape, 4, rows * 128))
    assert plan.to_dict()["gpu_memory_gb"]["companion:teacher"] == round(terms["companion:teacher"], 3)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_student_learns_the_teachers_distributions(tmp_path, tiny_data, precision):
    """Eight steps on the tiny data, forward KL, in fp32 and in bf16 (emulated on the CPU: the dtypes flow as on
    a GPU): the loss falls, the student moves towards the teacher on the held-out conversations (KL down,
    top-1 agreement up), and rank 0 held the whole teacher."""
    cfg = tiny_cfg(
        *STUDENT, "objective.beta=0", "method.learning_rate=3e-3", "train.max_steps=8", "train.save_steps=1000",
        "train.warmup_ratio=0.0", f"method.precision={precision}", run_dir=tmp_path / "run",
    )  # fmt: skip
    metrics = train_run(
        cfg, tiny_data, n_train=32, n_eval=8, max_generate=2, micro_batch_size=2, grad_accum_steps=1
    )
    steps = last_losses(tmp_path / "run")
    assert len(steps) == 8 and all(math.isfinite(x) for x in steps)
    assert sum(steps[-2:]) < 0.8 * sum(steps[:2]), steps
    assert metrics["train"]["distill"] == {"teacher_share": 1.0}
    assert metrics["train"]["engine"]["loss"] == "trl" and metrics["train"]["precision"] == precision
    assert metrics["train"]["engine"]["mixed_precision"] == ("bf16" if precision == "bf16" else "no")
    base, trained = metrics["eval"]["base"], metrics["eval"]["trained"]
    assert trained["teacher_kl"] < 0.8 * base["teacher_kl"], (base, trained)
    assert trained["teacher_top1_agreement"] > base["teacher_top1_agreement"]
    assert 0.0 <= base["teacher_top1_agreement"] <= 1.0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_the_planned_comparison_is_what_trls_divergence_allocates(beta, dtype_name):
    """TRL's `generalized_jsd_loss` over a micro-batch's whole logits, forward and backward, its live bytes
    counted as ops make and free them (scripts/bench_planner.py's LiveBytes), with the teacher's logits and the
    student's: the plan's comparison peak within 5%."""
    import torch
    from helpers import script_module

    from finetune.planner.companions import comparison_peak
    from finetune.train.distill_trainer import GKDTrainer

    dtype = getattr(torch, dtype_name)
    rows, seq_len, hidden, vocab = 4, 256, 64, 512
    cfg = tiny_cfg(*STUDENT, f"objective.beta={beta}")
    (shape,) = companions.shapes(cfg)
    states = torch.randn(rows, seq_len, hidden, dtype=dtype, requires_grad=True)
    head = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, seq_len))
    labels[:, :8] = -100  # the prompt's positions
    live = script_module("bench_planner").LiveBytes()
    with live:
        teacher = torch.randn(rows, seq_len, vocab, dtype=dtype)
        student = states @ head.T
        loss = GKDTrainer.generalized_jsd_loss(
            student[:, :-1],
            teacher[:, :-1],
            labels=labels[:, 1:],
            beta=beta,
            temperature=2.0,
            num_items_in_batch=1,
        )
        loss.backward()
    compute = 2 if dtype == torch.bfloat16 else 4
    assert comparison_peak(shape, compute, rows * seq_len) == pytest.approx(live.peak, rel=0.05)


def test_the_8b_recipe_plans_a_70b_teacher_sharded():
    from helpers import planned

    cfg, plan = planned("+recipe=llama8b_distill")
    (shape,) = companions.shapes(cfg)
    assert plan.fits and plan.strategy.engine.shards and cfg.hardware.total_gpus == 8
    assert shape.model.num_layers == 80 and shape.model.vocab_size == cfg.model.vocab_size
    teacher_gb = dict(plan.gpu_memory.companions)["companion:teacher"]
    # its bf16 weights over the 8 GPUs (17.6 GB), plus what its forward holds beyond the JSD's comparison
    weights = 2 * shape.params / 8 / 1e9
    assert weights == pytest.approx(17.6, abs=0.1) and weights <= teacher_gb < weights + 10
