"""The activation-memory formulas against the stored measurements and a live one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import script_module

from finetune.planner.activations import (
    LayerRun,
    LayerShape,
    attention_mask_bytes,
    autocast_weight_copy_bytes,
    layer_bytes_per_token,
    model_bytes_per_token,
)

ROOT = Path(__file__).resolve().parent.parent
MEASUREMENTS = json.loads((ROOT / "finetune" / "planner" / "activations.json").read_text())["measurements"]


SCRIPT = script_module("measure_activations")
CASES = SCRIPT.CASES


def _formula_bytes(row: dict) -> int:
    """The formula's bytes for a stored row (per token x tokens, plus per-layer constants)."""
    if row["case"].startswith("head"):
        hidden, vocab = row["dims"]
        per_token = model_bytes_per_token(
            hidden=hidden, vocab=vocab, trainable_head=row["case"] == "head_trainable"
        )
        return per_token * row["tokens"]
    return SCRIPT.formula_bytes(row)


def test_measurements_cover_the_big_shapes_and_all_cases():
    seen = {(r["shape"], r["case"]) for r in MEASUREMENTS}
    for shape in ("llama3_1_8b", "qwen2_5_32b", "llama3_1_70b"):
        for case in (
            "full", "lora_fp32", "lora_bf16", "lora_fp32_dropout", "full_ckpt", "lora_fp32_ckpt", "lora_fp32_autocast",
        ):  # fmt: skip
            assert (shape, case) in seen
    assert {r["case"] for r in MEASUREMENTS} >= set(CASES)  # every case measured somewhere
    assert len({r["shape"] for r in MEASUREMENTS if not r["case"].startswith("head")}) >= 10


@pytest.mark.parametrize("row", MEASUREMENTS, ids=lambda r: f"{r['shape']}-{r['case']}-{r['tokens']}")
def test_formula_reproduces_measurement(row: dict):
    measured = row["bytes"]
    assert _formula_bytes(row) == pytest.approx(measured, rel=0.01)
    if not row["case"].startswith("head"):  # layers: exact to the byte
        assert _formula_bytes(row) == measured


def test_design_reference_values():
    llama8b = LayerShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
    assert layer_bytes_per_token(llama8b, LayerRun(method="full")) == 200_840
    assert layer_bytes_per_token(llama8b, LayerRun(method="lora", adapter_bytes=4)) == 295_496
    assert layer_bytes_per_token(llama8b, LayerRun(method="lora", adapter_bytes=2)) == 184_680
    assert (
        layer_bytes_per_token(llama8b, LayerRun(method="lora", adapter_bytes=4, lora_dropout=True)) == 451_144
    )
    assert layer_bytes_per_token(llama8b, LayerRun(method="full", checkpointing=True)) == 8_192


def test_what_the_trainer_runs_on_the_8b_shape():
    """fp32 adapters under accelerate's autocast keep 18h + 8I + 6Hd + 4KVd + 4H + 8 + 14r (26% less than PEFT's
    upcast without autocast); CUDA's dropout keeps a 1-byte mask where the CPU keeps an a-byte noise tensor;
    packed rows copy k and v to every head."""
    llama8b = LayerShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
    h, i, q, kv = 4096, 14336, 4096, 1024
    autocast = layer_bytes_per_token(llama8b, LayerRun(method="lora", adapter_bytes=4, autocast=True))
    assert autocast == 18 * h + 8 * i + 6 * q + 4 * kv + 4 * 32 + 8 + 14 * 16 == 217_448
    cpu = layer_bytes_per_token(llama8b, LayerRun(method="lora", adapter_bytes=4, lora_dropout=True))
    cuda = layer_bytes_per_token(
        llama8b, LayerRun(method="lora", adapter_bytes=4, lora_dropout=True, device="cuda")
    )
    assert cpu - cuda == 3 * (5 * h + q + i)  # a 4-byte noise tensor vs a bool, per adapted input
    packed = layer_bytes_per_token(
        llama8b, LayerRun(method="lora", adapter_bytes=4, autocast=True, packed=True)
    )
    assert packed - autocast == 2 * 2 * (q - kv)
    assert attention_mask_bytes(tokens=8192, rows=1) == 134_217_728  # a bf16 [T, T] bias a layer


def test_bad_method_is_refused():
    with pytest.raises(ValueError, match="method"):
        LayerRun(method="dora")


@pytest.mark.parametrize(
    "case",
    [
        "full", "lora_fp32", "lora_bf16_dropout", "full_ckpt", "lora_fp32_ckpt", "lora_fp32_autocast",
        "lora_fp32_autocast_dropout", "full_fp32", "lora_fp32_base_dropout", "lora_bf16_fp32_base", "full_packed",
        "lora_bf16_packed",
    ],
)  # fmt: skip
def test_live_measurement_of_a_small_layer(case: str):
    shape = (256, 640, 4, 2, 64, False)
    measured = SCRIPT.measure_layer(shape, case, 64)
    row = dict(dims=list(shape), case=case, tokens=64)
    assert SCRIPT.formula_bytes(row) == measured


@pytest.mark.parametrize("case", ["full", "lora_fp32_autocast", "lora_bf16_dropout"])
def test_live_measurement_of_a_gemma_and_a_mistral_layer(case: str):
    """The families the planner takes besides Llama and Qwen2: Mistral's layer is Llama's; Gemma's keeps
    the same except a trainable norm's fp32 product (`fp32_norm_product`, 2 x hidden a norm) and the fp32
    (1 + weight) of each norm (a constant)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GemmaConfig, MistralConfig
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    shape = (256, 640, 4, 2, 64, False)
    h, inter, heads, kv, head_dim, _ = shape
    kw = CASES[case]
    for config_cls, layer_cls, gemma in (
        (MistralConfig, MistralDecoderLayer, False),
        (GemmaConfig, GemmaDecoderLayer, True),
    ):
        cfg = config_cls(
            hidden_size=h, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=head_dim, num_hidden_layers=1, vocab_size=256,
        )  # fmt: skip
        cfg._attn_implementation = "sdpa"
        measured = []
        for tokens in (64, 128):
            layer = layer_cls(cfg, layer_idx=0).to(torch.bfloat16)
            SCRIPT._init_(layer)
            if kw["method"] == "full":
                layer.requires_grad_(True)
            else:
                lcfg = LoraConfig(
                    r=16, lora_alpha=32, target_modules=SCRIPT.LORA_TARGETS,
                    lora_dropout=0.05 if kw.get("lora_dropout") else 0.0,
                )  # fmt: skip
                layer = get_peft_model(layer, lcfg, autocast_adapter_dtype=kw.get("adapter_bytes") == 4)
            measured.append(SCRIPT.measure_layer(shape, case, tokens, layer))
        per_token = (measured[1] - measured[0]) / 64
        expected = layer_bytes_per_token(
            LayerShape(hidden=h, intermediate=inter, heads=heads, kv_heads=kv, head_dim=head_dim, fp32_norm_product=gemma),
            LayerRun(**kw),
        )  # fmt: skip
        assert per_token == expected, config_cls.__name__


def test_live_measurement_of_the_head():
    script = SCRIPT
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
    script = SCRIPT
    b64, b128 = (script.measure_layer(shape, case, t, autocast=True) for t in (64, 128))
    per_token, constant = (b128 - b64) / 64, 2 * b64 - b128
    hidden, inter, heads, kv, head_dim, _ = shape
    assert per_token == layer_bytes_per_token(
        LayerShape(hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, head_dim=head_dim),
        LayerRun(method="full", checkpointing=case == "full_ckpt", autocast=True),
    )  # fmt: skip
    linear = hidden * (heads * head_dim + 2 * kv * head_dim) + heads * head_dim * hidden + 3 * hidden * inter
    assert constant == (0 if case == "full_ckpt" else autocast_weight_copy_bytes(linear))


def test_live_measurement_of_the_head_under_fp32_autocast():
    script = SCRIPT
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


def test_autocast_changes_nothing_for_bf16_adapters_and_needs_a_bf16_base():
    small = LayerShape(hidden=8, intermediate=8, heads=1, kv_heads=1, head_dim=8)
    lora = dict(method="lora", adapter_bytes=2)
    assert layer_bytes_per_token(small, LayerRun(**lora, autocast=True)) == layer_bytes_per_token(
        small, LayerRun(**lora)
    )  # measured: identical
    with pytest.raises(ValueError, match="autocast"):
        LayerRun(method="lora", adapter_bytes=4, autocast=True, dtype_bytes=4)


def test_import_does_not_load_torch():
    code = "import sys, finetune.planner.activations; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]
