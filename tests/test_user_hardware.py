"""Any GPU: profiles for common rentals with their published figures, `hardware=custom` by memory, peak and
price, and a price per GPU-hour that sets the monthly one."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from finetune.core.composition import compose, load_profiles, package_dir
from finetune.core.config import HardwareConfig

# name: (GB, TB/s, dense bf16 TFLOP/s, the name nvidia-smi prints)
PUBLISHED = {
    "rtx3090": (24, 0.936, 71, "NVIDIA GeForce RTX 3090"),
    "rtx5090": (32, 1.792, 209.5, "NVIDIA GeForce RTX 5090"),
    "rtx_a6000": (48, 0.768, 154.8, "NVIDIA RTX A6000"),
    "l40": (48, 0.864, 181, "NVIDIA L40"),
    "rtx_pro_6000": (96, 1.792, 503.8, "NVIDIA RTX PRO 6000 Blackwell Server Edition"),
}
# Fields a profile does not state: the node count, hardware=auto's list, what is read or derived at plan time.
NOT_STATED = {"nodes", "candidates", "disk_free_gb", "notes", "usd_per_gpu_hour"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_profile_states_every_field_with_its_published_figures(name: str) -> None:
    from finetune.rundir.machine import matching_profile

    gb, tb_s, tflops, gpu = PUBLISHED[name]
    stated = yaml.safe_load((package_dir("configs") / "hardware" / f"{name}.yaml").read_text())
    assert set(stated) == {f.name for f in dataclasses.fields(HardwareConfig)} - NOT_STATED
    hw = compose([f"hardware={name}", "mode=plan"]).hardware
    assert (hw.gpu_memory_gb, hw.hbm_tb_per_s, hw.peak_bf16_tflops, hw.device) == (gb, tb_s, tflops, "cuda")
    assert hw.usd_per_month is None and hw.gpu_hour_usd is None  # no published price: unknown, not guessed
    # a GPU of that name reporting its memory as torch does (about the datasheet's figure in GiB, less what
    # the driver keeps), in decimal GB, is planned as the profile
    match = matching_profile(gpu, 0.98 * gb * 2**30 / 1e9, 1, load_profiles())
    assert match is not None and match.name == name


def test_a_price_per_gpu_hour_sets_the_monthly_price() -> None:
    assert compose(["hardware=h100", "hardware.usd_per_gpu_hour=2.0"]).hardware.usd_per_month == 1460.0
    eight = compose(["hardware=h100x8", "hardware.usd_per_gpu_hour=2.0"]).hardware
    assert (eight.usd_per_month, eight.gpu_hour_usd) == (11680.0, 2.0)
    assert compose(["hardware=h100"]).hardware.gpu_hour_usd == pytest.approx(2190 / 730)


def test_custom_plans_any_gpu_by_its_figures() -> None:
    from finetune.planner import make_plan

    cfg = compose(
        [
            "model=llama3_1_8b",
            "method=qlora",
            "hardware=custom",
            "hardware.gpu_memory_gb=24",
            "hardware.peak_bf16_tflops=71",
            "hardware.usd_per_gpu_hour=0.25",
            "train.seq_len=2048",
            "train.max_steps=100",
        ]
    )
    plan = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, load_profiles())
    assert plan.fits and plan.hardware.name == "custom" and plan.usable_gpu_memory_gb < 24
    assert plan.estimate.run_hours is not None
    assert plan.estimate.usd == pytest.approx(plan.estimate.run_hours * 0.25)


def test_custom_without_its_memory_is_one_line(capsys) -> None:
    from finetune.pipeline.cli import main

    assert main(["hardware=custom", "mode=plan", "plan.out=/dev/null"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "hardware.gpu_memory_gb is unknown for profile 'custom'" in err
    assert "hardware.usd_per_gpu_hour" in err


@pytest.mark.parametrize("key", ["usd_per_gpu_hour", "peak_bf16_tflops", "usd_per_month"])
def test_a_negative_figure_is_refused(key: str) -> None:
    from finetune.core.errors import ConfigError

    with pytest.raises(ConfigError, match=f"hardware.{key}=-1"):
        compose(["hardware=custom", f"hardware.{key}=-1"])
