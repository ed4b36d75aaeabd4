"""Mixtral planned and trained under LoRA: transformers' MixtralExperts are Qwen3-MoE's fused grouped_mm experts
(its sparse layer measured: finetune/planner/activations.json, every row to the byte in test_activations.py);
what differs is its router (fp32 top-k weights, always renormalized) and its expert width, `intermediate_size`.
"""

from __future__ import annotations

import json

import pytest
from helpers import (
    EXPERT_LORA,
    TINY_MIXTRAL,
    four_steps_learn,
    planned,
    run_cli,
    tiny_model,
)

from finetune.core.config import MethodConfig
from finetune.planner.activations import LayerRun, LayerShape, layer_bytes_per_token
from finetune.planner.params import count_params, lora_params

# Mixtral-8x7B: h 4096, 32 layers, q 32 x 128, kv 8 x 128, 8 experts of I 14336, 2 routed
ATTENTION_R16 = 32 * 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096))
EXPERTS_R16 = 32 * 16 * 8 * ((4096 + 2 * 14336) + (14336 + 4096))


def test_tiny_mixtral_counts_exactly_and_its_adapters_are_peft_s(tiny_cache):
    """The tiny Mixtral's parameters, and PEFT's adapters on attention and on its 3-D experts, counted."""
    from peft import get_peft_model

    from finetune.modeling import tiny
    from finetune.modeling.loading import lora_config

    m = tiny_model(
        "mixtral", num_experts=4, num_experts_per_token=2, intermediate_size=48, norm_topk_prob=True
    )
    model = tiny.load_model(m)
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 4
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if "layers.0.mlp" in n}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 96, 64)
    assert sum(p.numel() for p in model.parameters()) == count_params(m).total == 164_672
    method = MethodConfig(name="lora", lora_rank=8, lora_dropout=0.0, lora_experts=True)
    peft = get_peft_model(model, lora_config(method, m))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    # attention: q, k, v, o; experts: r x E x ((h + 2I) + (I + h)) per layer
    per_layer = 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64)) + 8 * 4 * ((64 + 96) + (48 + 64))
    assert trainable == lora_params(m, method) == 2 * per_layer == 24_576


def test_the_router_is_what_differs_from_qwen3_moe():
    """Same shape, same experts: Mixtral's fp32, renormalized top-k weights keep 8k + 4 bytes a token where
    Qwen3-MoE keeps k in the compute dtype (and 4k + 4 more when it renormalizes)."""
    k = 2
    dims = dict(
        hidden=256, intermediate=128, heads=4, kv_heads=2, head_dim=64, experts=8, experts_per_token=k
    )
    run = LayerRun(method="lora", adapter_bytes=2)
    mixtral = layer_bytes_per_token(
        LayerShape(**dims, renormalized_routing=True, fp32_routing_weights=True), run
    )
    qwen = layer_bytes_per_token(LayerShape(**dims), run)
    qwen_norm = layer_bytes_per_token(LayerShape(**dims, renormalized_routing=True), run)
    attention = layer_bytes_per_token(LayerShape(**dims, qk_norm=True), run) - qwen
    assert mixtral == 6_924 and qwen_norm - qwen == 4 * k + 4 and mixtral - qwen == 6 * k + 4
    assert (
        attention == 8_468 - 6_908
    )  # Qwen3's q/k norms: the measured rows of both families (activations.json)


def test_mixtral_8x7b_is_planned_with_its_exact_counts():
    _, attn = planned("model=mixtral_8x7b", "method=lora", "hardware=h200")
    assert attn.params_total == 46_702_792_704 and attn.params_trainable == ATTENTION_R16 == 13_631_488
    _, experts = planned("model=mixtral_8x7b", "hardware=auto", *EXPERT_LORA)
    assert experts.params_trainable == ATTENTION_R16 + EXPERTS_R16 == 223_346_688
    assert experts.hardware.name == "h200" and experts.fits  # the cheapest profile that fits
    assert experts.gpu_memory.total > attn.gpu_memory.total


def test_mixtral_recipes_plan_as_their_comments_say(tmp_path):
    """mixtral_8x7b_lora: one H200, plan.json as the command line writes it; hardware=auto picks the same;
    its smoke sibling, the tiny Mixtral, on the CPU."""
    proc = run_cli("+recipe=mixtral_8x7b_lora", "mode=plan", f"run_dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert data["hardware"]["name"] == "h200" and data["fits"]
    assert data["params"] == {"total": 46_702_792_704, "trainable": 223_346_688, "active": 12_879_925_248}
    assert data["strategy"]["sharding"] == "none" and data["strategy"]["activation_checkpointing"]
    assert 100 < data["gpu_memory_gb"]["total"] < data["usable_gpu_memory_gb"]
    cfg, auto = planned("+recipe=mixtral_8x7b_lora", "hardware=auto")
    assert auto.hardware.name == "h200" and cfg.smoke.sibling == "tiny_mixtral"
    _, h100 = planned("+recipe=mixtral_8x7b_lora", "hardware=h100")
    assert not h100.fits
    smoke, tiny = planned("+recipe=tiny_mixtral")
    assert smoke.model.architecture == "mixtral" and smoke.hardware.device == "cpu" and tiny.fits
    assert tiny.params_total == count_params(smoke.model).total


@pytest.mark.slow
def test_tiny_mixtral_trains_with_lora_on_attention_and_experts(tmp_path, tiny_cache, tiny_data):
    four_steps_learn(tmp_path, tiny_data, *TINY_MIXTRAL, *EXPERT_LORA)


def test_serve_sh_for_expert_adapters_serves_the_merged_model(tmp_path):
    """vLLM's loading of PEFT's fused-expert adapters is unchecked: serve.sh offers the merged model alone, with
    the line saying why; an attention-only adapter keeps vLLM's multi-LoRA variant."""
    from finetune.export import serve

    cfg, plan = planned("+recipe=mixtral_8x7b_lora")
    commands = serve.serve_commands(
        cfg, plan, merged=True, adapter=True, base_source="mistralai/Mixtral-8x7B-v0.1"
    )
    assert [c.variant for c in commands] == ["merged", "fp8"]
    assert commands[0].line.startswith("vllm serve ./merged --served-model-name mixtral_8x7b_lora ")
    serve.write(cfg, tmp_path / "serve.sh", commands)
    text = (tmp_path / "serve.sh").read_text()
    assert f"# {serve.EXPERT_ADAPTER_NOTE}." in text.splitlines()
    assert "--enable-lora" not in text and "bash serve.sh [merged|fp8]" in text
    # without the merged weights, the adapter line stays, carrying the same warning
    (lora,) = serve.serve_commands(
        cfg, plan, merged=False, adapter=True, base_source="mistralai/Mixtral-8x7B-v0.1"
    )
    assert lora.variant == "lora" and "--enable-lora" in lora.argv and serve.EXPERT_ADAPTER_NOTE in lora.note
    attention, _ = planned("+recipe=mixtral_8x7b_lora", "method.lora_experts=false")
    variants = [
        c.variant for c in serve.serve_commands(attention, plan, merged=True, adapter=True, base_source="m")
    ]
    assert variants == ["merged", "lora", "fp8"]
