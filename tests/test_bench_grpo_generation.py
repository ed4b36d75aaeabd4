"""scripts/bench_grpo_generation.py --quick: one GRPO case, its table and its JSON (the timings nest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import REPO, child_env


def test_generation_share_nests_inside_the_step(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_grpo_generation.py"), "--quick", "--json", str(out)],
        cwd=REPO,
        env=child_env(FINETUNE_CACHE=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| max completion | completions / step |" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert (row["max_completion_length"], row["completions_per_step"], row["steps_measured"]) == (8, 4, 1)
    # sampling is part of the rollout, the rollout part of TRL's step time
    assert 0 < row["generate_s"] <= row["rollout_s"] <= row["step_s"]
    assert row["generation_share"] == row["generate_s"] / row["step_s"]
    assert 0 < row["mean_completion_length"] <= 8
