"""The plan as people read it: a CPU plan speaks of RAM, the alternatives are the best few trades with usable
memory, strategy, prices per GPU-hour and month and the run's cost, and a job that does not fit is told
which method changes would fit, with their figures."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from finetune.core.composition import compose, load_profiles
from finetune.core.config.hardware import HOURS_PER_MONTH
from finetune.pipeline.plan_report import print_plan
from finetune.planner import make_plan
from finetune.planner.advice import SHORTLIST, shortlist

PROFILES = load_profiles()


def _plan(*overrides: str):
    cfg = compose([*overrides, "mode=plan"])
    hw = cfg.hardware
    if hw.device == "cpu" and hw.gpu_memory_gb is None:  # as the pipeline reads this machine's RAM
        from dataclasses import replace

        hw = replace(hw, gpu_memory_gb=32.0, host_memory_gb=32.0)
    return make_plan(cfg.model, cfg.method, hw, cfg.train, cfg.plan, PROFILES)


def _printed(plan) -> str:
    console = Console(record=True, width=220)
    print_plan(plan, "job", console)
    return console.export_text()


def test_a_cpu_plan_speaks_of_ram_not_gpus() -> None:
    plan = _plan()  # the embedded default: the tiny model on the CPU
    text = _printed(plan)
    head = text.strip().splitlines()[0]
    # 0.7 GB, or 0.8 where mlflow and wandb are installed (the worker imports them: MEMORY_MODEL.md, section 6)
    total = f"{plan.gpu_memory.total:.1f}"
    assert total in ("0.7", "0.8")
    assert head == f"job on cpu (32 GB RAM): FITS  - {total} GB of 28.8 GB usable RAM"
    assert "memory (GB of RAM)" in text and "GPU memory per GPU" not in text
    assert plan.reasons[0] == f"fits as configured: {total} GB of 28.8 GB usable RAM"


def test_alternatives_are_the_best_few_with_their_prices() -> None:
    plan = _plan("+recipe=llama8b_lora", "hardware=h100", "train.max_steps=200")
    shown = shortlist(plan)
    assert 0 < len(shown) <= SHORTLIST < len(plan.alternatives)
    assert all(a.fits and a.hardware != "h100" for a in shown)
    # none of those shown is beaten on both cost and speed by another that fits
    fitting = [a for a in plan.alternatives if a.fits and a.hardware != "h100"]
    for a in shown:
        assert not any(
            b.run_usd < a.run_usd and b.tokens_per_second > a.tokens_per_second
            for b in fitting
            if b.run_usd is not None and a.run_usd is not None
        )
    for a in plan.alternatives:
        hw = PROFILES[a.hardware]
        assert a.usable_gb == pytest.approx(hw.gpu_memory_gb * (1 - 0.1), abs=0.01)
        if hw.usd_per_month is None:
            assert a.usd_per_gpu_hour is None and a.run_usd is None
        else:
            assert a.usd_per_gpu_hour == pytest.approx(
                hw.usd_per_month / hw.gpus_per_node / HOURS_PER_MONTH, rel=1e-3
            )
            assert a.run_usd == pytest.approx(
                a.run_hours * hw.usd_per_month * hw.nodes / HOURS_PER_MONTH, rel=1e-3
            )
    text = _printed(plan)
    for column in ("GB/GPU", "usable", "USD/GPU-h", "USD/month", "run h", "run USD", "strategy there"):
        assert column in text
    assert f"{len(plan.alternatives) - 1 - len(shown)} more profiles weighed" in text


def test_an_alternative_that_runs_otherwise_says_how() -> None:
    plan = _plan("+recipe=llama8b_lora", "hardware=h100")
    by_name = {a.hardware: a for a in plan.alternatives}
    # eight GPUs divide the work: the strategy differs from the one-GPU plan's, and is named
    assert by_name["h100x8"].strategy is not None and "over 8 GPUs" in by_name["h100x8"].strategy
    same = [a for a in plan.alternatives if a.strategy is None]
    assert same and all(PROFILES[a.hardware].total_gpus == 1 for a in same)


def test_a_job_that_does_not_fit_is_told_the_method_changes_that_would() -> None:
    plan = _plan(
        "model=llama3_1_8b",
        "method=lora",
        "method.lora_rank=2048",
        "method.lora_alpha=4096",
        "hardware=rtx4090",
        "train.seq_len=2048",
    )
    assert not plan.fits
    rank = next(s for s in plan.suggestions if s.startswith("method.lora_rank="))
    assert rank.startswith("method.lora_rank=64 fits on rtx4090 (") and rank.endswith(" GB per GPU)")
    lower = _plan(
        "model=llama3_1_8b", "method=lora", "method.lora_rank=64", "method.lora_alpha=128", "hardware=rtx4090",
        "train.seq_len=2048",
    )  # fmt: skip
    assert lower.fits and f"({lower.gpu_memory.total:.1f} GB per GPU)" in rank
    big = _plan("+recipe=llama70b_lora", "hardware=h100")
    assert any(s.startswith("method=qlora fits on h100 (") for s in big.suggestions)


def test_a_seq_len_suggestion_on_the_cpu_speaks_of_ram() -> None:
    plan = _plan(
        "model=llama3_2_3b", "method=lora", "train.seq_len=65536", "train.activation_checkpointing=false"
    )
    assert not plan.fits
    shorter = next(s for s in plan.suggestions if s.startswith("train.seq_len="))
    assert shorter.endswith(" GB RAM)") and "GPU" not in shorter
    assert math.isfinite(float(shorter.split("(")[1].split(" GB")[0]))
