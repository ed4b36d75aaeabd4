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
    from gpu_pipeline import MEMORY_CASES

    runs = [c for c in MEMORY_CASES if not c.get("recipe")]
    assert {c["method"] for c in runs} == {"full", "lora", "qlora"}
    assert {c["chunked"] for c in runs} == {True, False} and {c["ckpt"] for c in runs} == {True, False}
    assert all(c["optimizer"] == "adamw_8bit" for c in runs if c["method"] == "full")
    assert [c["name"] for c in MEMORY_CASES if c.get("recipe")] == ["tiny-recipe-pipeline"]
    # the budget gpu_check.sh gives the default (memory) suite: at most the last case may be skipped
    assert sum(c["est_s"] for c in MEMORY_CASES[:-1]) <= 300


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


def test_throughput_cases_cover_each_lever_and_both_row_shapes():
    from gpu_pipeline import CASES, MEMORY_CASES, THROUGHPUT_CASES, case_args, select

    lora = [c for c in THROUGHPUT_CASES if c["method"] == "lora"]
    assert {c.get("attention", "sdpa") for c in lora} == {"sdpa", "flex", "flash"}
    assert {c["data"] for c in lora} == {"packed", "single"}
    assert {c.get("mb", 1) for c in lora if c["data"] == "packed"} == {1, 2, 4}
    assert any(c.get("compile") for c in lora) and any(c.get("liger") for c in lora)
    assert {c["needs"] for c in lora if "needs" in c} == {"flash_attn", "liger_kernel"}  # skipped if absent
    assert {c["method"] for c in THROUGHPUT_CASES} == {"lora", "qlora", "full"}  # the three MFU targets
    assert all(c["seq_len"] == 8192 for c in THROUGHPUT_CASES if c["method"] != "full")
    # Throughput first, then the memory cases; --suite picks one; --only any of several names.
    assert CASES == THROUGHPUT_CASES + MEMORY_CASES and select(CASES, "memory", None) == MEMORY_CASES
    assert [c["name"] for c in select(CASES, "all", ["single", "tiny-recipe"])] == [
        "lora-single-sdpa",
        "tiny-recipe-pipeline",
    ]
    flex = next(c for c in lora if c.get("attention") == "flex")
    args = case_args(flex, Path("r"), Path("c"), cpu=False, data_file=Path("d/packed.jsonl"))
    for arg in (
        "train.attention=flex",
        "train.profile=true",
        "data.packing=true",
        "data.path=d/packed.jsonl",
    ):
        assert arg in args
    assert "train.micro_batch_size=4" in case_args(
        next(c for c in lora if c.get("mb") == 4), Path("r"), Path("c"), cpu=False, data_file=Path("d")
    )
    memory = case_args(MEMORY_CASES[0], Path("r"), Path("c"), cpu=False)
    assert "train.profile=true" in memory and not any(
        a.startswith("data.") and "cache" not in a for a in memory
    )


@pytest.mark.parametrize("kind", ["packed", "single"])
def test_generated_data_fills_8k_rows_as_asked(tmp_path, tiny_cache, kind):
    """At the GPU size (8,192 tokens, the 8B shape's tokenizer): about 30 samples a row, or one sample
    filling 85% of a row, counted in the tokens the data stage will see."""
    from gpu_pipeline import SINGLE_FILL, write_data

    from finetune.core.config import ModelConfig
    from finetune.modeling import tiny

    path = write_data(tmp_path / f"{kind}.jsonl", kind, 8192, 30, 128256)
    tok = tiny.load_tokenizer(ModelConfig(vocab_size=128256))
    lengths = [
        len(
            tok(
                tok.apply_chat_template(json.loads(line)["messages"], tokenize=False),
                add_special_tokens=False,
            )["input_ids"]
        )
        for line in path.read_text().splitlines()
    ]
    mean = sum(lengths) / len(lengths)
    if kind == "packed":
        assert 8192 / mean == pytest.approx(30 / 0.95, rel=0.1) and max(lengths) < 8192 / 10
    else:
        assert mean == pytest.approx(SINGLE_FILL * 8192, rel=0.05) and max(lengths) <= 8192


@pytest.mark.slow
@pytest.mark.extended  # two minutes; the pipeline script's own CPU run below stays in CI
def test_throughput_suite_on_the_cpu(tmp_path, tiny_cache):
    """The throughput cases through the real pipeline on the CPU: packed rows really hold several samples,
    single rows one; each step is split; the micro-batch is the case's; flex is skipped (no CPU backward)."""
    result = _pipeline(
        tmp_path, "--cpu", "--suite", "throughput", "--budget-s", "1500",
        "--only", "lora-packed-sdpa", "--only", "lora-single", "--only", "lora-packed-mb2", "--only", "lora-packed-flex",
    )  # fmt: skip
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"lora-packed-sdpa", "lora-single-sdpa", "lora-packed-mb2", "lora-packed-flex"}
    assert rows["lora-packed-flex"]["skipped"].startswith("needs CUDA")
    for name in ("lora-packed-sdpa", "lora-single-sdpa", "lora-packed-mb2"):
        row = rows[name]
        assert row["ok"] and row["problems"] == [], row
        assert row["engine"]["attention"] == "sdpa" and row["steady_tokens_per_second"] > 0
        assert sum(row["split"].values()) == pytest.approx(1.0, abs=0.2)
        assert row["split"]["forward"] > 0 and row["split"]["backward"] > 0 and row["split"]["optimizer"] > 0
        assert any("scaled_dot_product" in op for op in row["attention_ops"])
        assert row["eval"]["trained"] < row["eval"]["base"]
    assert rows["lora-packed-sdpa"]["data"]["samples_per_row"] >= 3
    assert rows["lora-single-sdpa"]["data"]["samples_per_row"] == 1.0
    assert rows["lora-single-sdpa"]["data"]["context"] > 3 * rows["lora-packed-sdpa"]["data"]["context"]
    assert rows["lora-packed-mb2"]["engine"]["micro_batch_size"] == 2
    text = (tmp_path / "pipeline.md").read_text()
    assert "| lora-packed-sdpa | yes |" in text and "| lora-packed-flex | SKIPPED |" in text


@pytest.mark.slow
def test_pipeline_script_on_the_cpu(tmp_path, tiny_cache):
    # LoRA and QLoRA (names with "lora-chunked-ckpt"); the rows without checkpointing run in the throughput
    # suite's CPU test (-m extended)
    result = _pipeline(tmp_path, "--cpu", "--only", "lora-chunked-ckpt", "--budget-s", "1200")
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"lora-chunked-ckpt", "qlora-chunked-ckpt"}
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
        if row.get("skipped"):  # flash-attn not installed, or the budget
            continue
        assert row["ok"], row
        assert row["peak_source"] == "cuda_max_allocated" and row["peak_gb"] > 1.0
