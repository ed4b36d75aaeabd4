"""A non-editable install finds its configs and recipes from any directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_configs_and_recipes(tmp_path: Path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("finetune-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert (target / "finetune" / "_recipes" / "llama70b_qlora.yaml").is_file()
    assert (target / "finetune" / "_configs" / "model" / "llama3_1_70b.yaml").is_file()
    out = tmp_path / "plan.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "+recipe=llama70b_qlora", "mode=plan", f"plan.out={out}"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert plan["fits"] is True and plan["hardware"]["name"] == "h100"
    # It ran the installed copy, not the repository's.
    probe = subprocess.run(
        [sys.executable, "-c", "import finetune; print(finetune.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip().startswith(str(target))
    assert (elsewhere / "runs" / "llama70b_qlora" / "plan.json").is_file()
