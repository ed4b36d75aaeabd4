"""scripts/gpu_pipeline.py: the real pipeline's GPU check, proven on the CPU and run for real where CUDA is.

pytest -m gpu tests/test_gpu_pipeline.py      # on a GPU machine (skipped without CUDA)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_pipeline.py"
sys.path.insert(0, str(ROOT / "scripts"))


def _pipeline(out: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "pipeline.json").read_text())


def test_cases_cover_every_method_loss_path_and_checkpointing():
    from gpu_pipeline import CASES

    runs = [c for c in CASES if not c.get("recipe")]
    assert {c["method"] for c in runs} == {"full", "lora", "qlora"}
    assert {c["chunked"] for c in runs} == {True, False} and {c["ckpt"] for c in runs} == {True, False}
    assert all(c["optimizer"] == "adamw_8bit" for c in runs if c["method"] == "full")
    assert [c["name"] for c in CASES if c.get("recipe")] == ["tiny-recipe-pipeline"]
    assert (
        sum(c["est_s"] for c in CASES[:-1]) <= 300
    )  # the budget gpu_check.sh gives: only the last may be skipped


def test_the_8b_shape_is_the_design_reference():
    from gpu_pipeline import SHAPE_8B, case_args

    args = case_args(
        {"name": "x", "method": "lora", "seq_len": 8192, "chunked": True, "ckpt": False},
        Path("r"),
        Path("c"),
        cpu=False,
    )
    assert set(SHAPE_8B) <= set(args) and "model.vocab_size=128256" in args and "model.num_layers=4" in args
    assert "hardware=h200" in args and "method.precision=bf16" in args and "train.seq_len=8192" in args
    recipe = case_args({"name": "tiny-recipe-pipeline", "recipe": True}, Path("r"), Path("c"), cpu=False)
    assert "hardware=h200" in recipe and not any(a.startswith(("model", "method")) for a in recipe)


@pytest.mark.slow
def test_pipeline_script_on_the_cpu(tmp_path, tiny_cache):
    result = _pipeline(tmp_path, "--cpu", "--only", "lora-chunked", "--budget-s", "1200")
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {
        "lora-chunked",
        "lora-chunked-ckpt",
        "qlora-chunked-ckpt",
    }  # names with "lora-chunked"
    for name, row in rows.items():
        assert row["ok"] and row["rc"] == 0 and row["problems"] == [], row
        engine = row["engine"]
        assert engine["mixed_precision"] == "bf16" and engine["loss"] == "chunked"
        assert engine["activation_checkpointing"] is name.endswith("ckpt")
        assert (
            row["peak_source"] == "process_peak_rss" and row["plan_gb"] > 0 and row["tokens_per_second"] > 0
        )
        assert row["eval"]["trained"] < row["eval"]["base"]  # 4 steps at the default LoRA rate
    text = (tmp_path / "pipeline.md").read_text()
    assert all(f"| {name} | yes |" in text for name in rows)


@pytest.mark.gpu
@pytest.mark.slow
def test_pipeline_on_cuda(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    result = _pipeline(tmp_path, "--only", "lora", "--budget-s", "600")
    for row in result["rows"]:
        assert row["ok"], row
        assert row["peak_source"] == "cuda_max_allocated" and row["peak_gb"] > 1.0
