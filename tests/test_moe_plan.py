"""Qwen3-MoE planned under LoRA: the sparse layer's saved bytes against a measurement, the plan's exact counts
and adapters (attention only, or the fused experts through PEFT's target_parameters), and one-line refusals
for what was not measured."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import planned, script_module

from finetune.core.config import ModelConfig
from finetune.core.errors import ConfigError, PlanError
from finetune.planner.activations import LayerRun, LayerShape, folded_expert_bytes, layer_bytes_per_token
from finetune.planner.search import check_model

REPO = Path(__file__).resolve().parent.parent
# Qwen3-30B-A3B: h 2048, 48 layers, q 32 x 128, kv 4 x 128, 128 experts of I 768, 8 routed
ATTENTION_R16 = 48 * 16 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))
EXPERTS_R16 = 48 * 16 * 128 * ((2048 + 2 * 768) + (768 + 2048))


def test_qwen3_30b_a3b_lora_on_attention_is_planned_with_its_exact_counts():
    cfg, plan = planned("model=qwen3_30b_a3b", "method=lora", "hardware=h100")
    assert cfg.method.targets("qwen3_moe") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert plan.params_total == 30_532_122_624
    assert plan.params_trainable == ATTENTION_R16 == 13_369_344
    assert plan.fits


def test_lora_on_the_experts_counts_peft_s_adapters_and_the_folded_weights():
    overrides = ("model=qwen3_30b_a3b", "method=lora", "hardware=h100")
    _, attn = planned(*overrides, "method.lora_dropout=0")
    _, experts = planned(*overrides, "method.lora_dropout=0", "method.lora_experts=true")
    assert experts.params_trainable == ATTENTION_R16 + EXPERTS_R16 == 642_514_944
    assert experts.gpu_memory.total > attn.gpu_memory.total


def test_lora_experts_needs_no_dropout_and_a_mixture_of_experts():
    with pytest.raises(ConfigError, match="method.lora_experts=true needs method.lora_dropout=0"):
        planned("model=qwen3_30b_a3b", "method=lora", "method.lora_experts=true")
    with pytest.raises(ConfigError, match="method.lora_experts=true: llama has no fused experts"):
        planned("model=llama3_1_8b", "method=lora", "method.lora_dropout=0", "method.lora_experts=true")


@pytest.mark.parametrize(
    "overrides,why",
    [
        (("method=qlora",), "bitsandbytes quantizes nn.Linear only"),
        (("model.dense_layers=2",), "its 2 dense layers among the sparse ones were not measured"),
    ],
)
def test_what_was_not_measured_is_refused_in_one_line(overrides, why):
    with pytest.raises(PlanError) as err:
        planned("model=qwen3_30b_a3b", "hardware=h100", *overrides)
    assert why in str(err.value) and " active a token) is not planned: " in str(err.value)
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_an_unmeasured_sparse_layer_is_refused():
    m = ModelConfig(
        architecture="qwen2_moe", hidden_size=64, num_experts=8, num_experts_per_token=2, intermediate_size=96
    )
    with pytest.raises(PlanError, match="qwen2_moe.s sparse layer was not measured"):
        check_model(m)


@pytest.mark.slow  # builds and measures a decoder layer (about a minute on a shared core)
@pytest.mark.parametrize("experts", [False, True])
def test_the_sparse_layer_formula_is_the_measured_bytes(experts):
    """One Qwen3-MoE layer (grouped_mm experts, bf16), LoRA r16: the per-token slope and the folded weights."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    script = script_module("measure_activations")
    h, i, heads, kv, d, e, k = 256, 128, 4, 2, 64, 8, 2
    hf = Qwen3MoeConfig(
        hidden_size=h, moe_intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv, head_dim=d,
        num_experts=e, num_experts_per_tok=k, num_hidden_layers=1, vocab_size=256, intermediate_size=4 * i,
    )  # fmt: skip
    hf._attn_implementation, hf._experts_implementation = "sdpa", "grouped_mm"
    with torch.device("meta"):
        layer = Qwen3MoeDecoderLayer(hf, layer_idx=0)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    script._init_(layer)
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None,
    )  # fmt: skip
    shape = (h, i, heads, kv, d, False)
    at = {
        t: script.measure_layer(
            shape, "lora_bf16", t, get_peft_model(copy.deepcopy(layer), lora, autocast_adapter_dtype=False)
        )
        for t in (64, 128)
    }
    sh = LayerShape(
        hidden=h,
        intermediate=i,
        heads=heads,
        kv_heads=kv,
        head_dim=d,
        qk_norm=True,
        experts=e,
        experts_per_token=k,
    )
    run = LayerRun(method="lora", adapter_bytes=2, expert_adapters=experts)
    assert (at[128] - at[64]) // 64 == layer_bytes_per_token(sh, run) == (10_004 if experts else 8_468)
    # the constant: the folded expert weights (bf16) and grouped_mm's int32 offsets, 4 bytes an expert
    assert 2 * at[64] - at[128] == folded_expert_bytes(sh, run) + 4 * e


def test_the_moe_recipes_plan_as_their_comments_say(tmp_path):
    """qwen3_30b_a3b_lora: one H200 (LoRA on attention and experts), plan.json as the command line writes it;
    its smoke sibling, the tiny Qwen3-MoE, on the CPU."""
    import json

    from helpers import run_cli

    proc = run_cli("+recipe=qwen3_30b_a3b_lora", "mode=plan", f"run_dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert data["hardware"]["name"] == "h200" and data["fits"]
    assert data["params"] == {"total": 30_532_122_624, "trainable": 642_514_944, "active": 3_353_032_704}
    assert data["strategy"]["sharding"] == "none" and data["strategy"]["activation_checkpointing"]
    cfg, _ = planned("+recipe=qwen3_30b_a3b_lora")
    assert (cfg.smoke.sibling, cfg.method.lora_experts, cfg.method.lora_dropout) == ("tiny_moe", True, 0.0)
    # without the experts' adapters it fits one H100, as the recipe's note says
    _, h100 = planned("+recipe=qwen3_30b_a3b_lora", "hardware=h100", "method.lora_experts=false")
    assert h100.fits and h100.params_trainable == ATTENTION_R16
    smoke, tiny = planned("+recipe=tiny_moe")
    assert smoke.model.architecture == "qwen3_moe" and smoke.hardware.device == "cpu" and tiny.fits
