"""smoke=true: the sibling's pipeline with its checks, and the refusal that stops the real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.core.errors import LaunchError
from finetune.pipeline import smoke
from finetune.pipeline.cli import compose


def test_sibling_overrides_keep_the_users_settings_but_not_the_real_runs():
    cfg = compose(["+recipe=llama70b_qlora", "smoke=true", "smoke.steps=12", "run_dir=/tmp/r"])
    args = [
        "+recipe=llama70b_qlora",
        "smoke=true",
        "smoke.steps=12",
        "hardware=h200",
        "method.lora_rank=8",
        "run_dir=/tmp/r",
    ]
    tiny = smoke.sibling_overrides(cfg, args, "tiny")
    assert tiny[0] == "+recipe=tiny"
    assert "method.lora_rank=8" in tiny
    assert "hardware=h200" not in tiny  # tiny runs on the CPU profile
    assert "run_dir=/tmp/r/smoke" in tiny and "train.max_steps=12" in tiny and "train.save_steps=6" in tiny
    assert not any(a.startswith(("smoke", "+recipe=llama70b")) for a in tiny)
    eight = smoke.sibling_overrides(cfg, args, "llama8b_qlora")
    assert eight[0] == "+recipe=llama8b_qlora" and "hardware=h200" in eight
    sibling = compose(eight)
    assert sibling.model.name == "llama3_1_8b" and sibling.train.max_steps == 12


def test_unreachable_hub_falls_back_to_tiny(tmp_path: Path, monkeypatch):
    cfg = compose(["+recipe=llama70b_qlora", "smoke=true", f"run_dir={tmp_path}"])
    seen = {}

    def fake_stages(c):
        seen["model"] = c.model.name
        raise LaunchError("stop here")

    monkeypatch.setattr("finetune.pipeline.stages.run", fake_stages)
    with pytest.raises(LaunchError, match="smoke run failed .*the real run was not launched"):
        smoke.run(cfg, ["+recipe=llama70b_qlora", "smoke=true"], hub_check=lambda: False)
    assert seen["model"] == "tiny"
    report = json.loads((tmp_path / "smoke" / "smoke_report.json").read_text())
    assert report["ok"] is False and report["sibling"] == "tiny"
    assert report["notes"] == ["model hub unreachable: tiny stands in for llama8b_qlora"]


@pytest.mark.slow
def test_smoke_pipeline_checks_train_save_resume_merge(tmp_path: Path):
    cfg = compose(["smoke=true", "smoke.steps=8", f"run_dir={tmp_path}"])
    result = smoke.run(cfg, ["smoke=true", "smoke.steps=8"])
    checks = {c["check"]: c for c in result["checks"]}
    assert result["ok"] and set(checks) == {
        "train",
        "longest sample first",
        "memory within plan",
        "save",
        "resume",
        "merge",
    }
    assert all(c["ok"] for c in checks.values())
    train = json.loads((tmp_path / "smoke" / "metrics.json").read_text())["train"]
    assert train["steps"] == 8 + smoke.RESUME_EXTRA_STEPS
    assert train["resumed_from"].endswith("checkpoint-8")
    # The export of step 8 was moved aside when the resumed run saved the step-10 model.
    assert (
        json.loads((tmp_path / "smoke" / "superseded-export" / "merge_check.json").read_text())["ok"] is True
    )
    assert not (tmp_path / "smoke" / "export").exists()
