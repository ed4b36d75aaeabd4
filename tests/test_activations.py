"""The activation-memory formulas against the stored measurements and a live one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from finetune.planner._activations import (
    autocast_weight_copy_bytes,
    layer_bytes_per_token,
    model_bytes_per_token,
)

ROOT = Path(__file__).resolve().parent.parent
MEASUREMENTS = json.loads((ROOT / "finetune" / "planner" / "activations.json").read_text())["measurements"]


def _script() -> ModuleType:
    path = ROOT / "scripts" / "measure_activations.py"
    spec = importlib.util.spec_from_file_location("measure_activations", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _script().CASES


def _formula(dims: list, case: str) -> int:
    if case.startswith("head"):
        hidden, vocab = dims
        return model_bytes_per_token(hidden=hidden, vocab=vocab, trainable_head=case == "head_trainable")
    hidden, inter, heads, kv, head_dim, bias = dims
    return layer_bytes_per_token(
        hidden=hidden,
        intermediate=inter,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        attention_bias=bias,
        **CASES[case],
    )


def test_measurements_cover_the_big_shapes_and_all_cases():
    seen = {(r["shape"], r["case"]) for r in MEASUREMENTS}
    for shape in ("llama3_1_8b", "qwen2_5_32b", "llama3_1_70b"):
        for case in ("full", "lora_fp32", "lora_bf16", "lora_fp32_dropout", "full_ckpt", "lora_fp32_ckpt"):
            assert (shape, case) in seen
    assert len({r["shape"] for r in MEASUREMENTS if not r["case"].startswith("head")}) >= 10


@pytest.mark.parametrize("row", MEASUREMENTS, ids=lambda r: f"{r['shape']}-{r['case']}-{r['tokens']}")
def test_formula_reproduces_measurement(row: dict):
    measured = row["bytes_per_token"]
    assert _formula(row["dims"], row["case"]) == pytest.approx(measured, rel=0.01)
    if not row["case"].startswith("head"):  # layers keep nothing that does not scale with tokens
        assert _formula(row["dims"], row["case"]) == measured


def test_design_reference_values():
    llama8b = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
    assert layer_bytes_per_token(**llama8b, method="full") == 200_840
    assert layer_bytes_per_token(**llama8b, method="lora", adapter_bytes=4) == 295_496
    assert layer_bytes_per_token(**llama8b, method="lora", adapter_bytes=2) == 184_680
    assert layer_bytes_per_token(**llama8b, method="lora", adapter_bytes=4, lora_dropout=True) == 451_144
    assert layer_bytes_per_token(**llama8b, method="full", checkpointing=True) == 8_192


def test_bad_method_is_refused():
    with pytest.raises(ValueError, match="method"):
        layer_bytes_per_token(hidden=8, intermediate=8, heads=1, kv_heads=1, head_dim=8, method="dora")


@pytest.mark.parametrize("case", ["full", "lora_fp32", "lora_bf16_dropout", "full_ckpt", "lora_fp32_ckpt"])
def test_live_measurement_of_a_small_layer(case: str):
    script = _script()
    shape = (256, 640, 4, 2, 64, False)
    measured = script.measure_layer(shape, case, 64)
    assert script.formula(shape, case) * 64 == measured


def test_live_measurement_of_the_head():
    script = _script()
    for trainable in (True, False):
        measured = script.measure_head(128, 512, 64, trainable) / 64
        assert model_bytes_per_token(hidden=128, vocab=512, trainable_head=trainable) == pytest.approx(
            measured, rel=0.01
        )


@pytest.mark.parametrize("shape", [(256, 688, 4, 4, 64, False), (384, 1000, 6, 3, 32, False)])
@pytest.mark.parametrize("case", ["full", "full_ckpt"])
def test_live_measurement_under_fp32_autocast(shape: tuple, case: str):
    """Full fine-tuning the trainer's way: fp32 weights under bf16 autocast. Per token (the slope over two
    token counts) the formula's bytes; per layer, autocast's bf16 copy of each weight (none when the
    layer is checkpointed: its forward runs without saving)."""
    script = _script()
    b64, b128 = (script.measure_layer(shape, case, t, autocast=True) for t in (64, 128))
    per_token, constant = (b128 - b64) / 64, 2 * b64 - b128
    hidden, inter, heads, kv, head_dim, _ = shape
    assert per_token == layer_bytes_per_token(
        hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, head_dim=head_dim, method="full",
        checkpointing=case == "full_ckpt", autocast=True,
    )  # fmt: skip
    linear = hidden * (heads * head_dim + 2 * kv * head_dim) + heads * head_dim * hidden + 3 * hidden * inter
    assert constant == (0 if case == "full_ckpt" else autocast_weight_copy_bytes(linear))


def test_live_measurement_of_the_head_under_fp32_autocast():
    script = _script()
    hidden, vocab = 128, 512
    b64, b128 = (script.measure_head(hidden, vocab, t, True, autocast=True) for t in (64, 128))
    per_token, constant = (b128 - b64) / 64, 2 * b64 - b128
    assert per_token == model_bytes_per_token(hidden=hidden, vocab=vocab, trainable_head=True, autocast=True)
    # the head's bf16 weight copy, and a few scalars of the loss
    assert (
        autocast_weight_copy_bytes(hidden * vocab)
        <= constant
        <= autocast_weight_copy_bytes(hidden * vocab) + 16
    )


def test_autocast_is_for_full_fine_tuning_only():
    with pytest.raises(ValueError, match="autocast"):
        layer_bytes_per_token(
            hidden=8, intermediate=8, heads=1, kv_heads=1, head_dim=8, method="lora", autocast=True
        )


def test_import_does_not_load_torch():
    code = "import sys, finetune.planner._activations; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]
