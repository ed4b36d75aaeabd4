"""Full fine-tuning of a mixture of experts: planned (every expert's weights, gradients and AdamW states; the
sparse layer's saved bytes measured, activations.json's moe_full rows) and trained in one process; QLoRA refused
with the split bitsandbytes really makes (measured here on the tiny Qwen3-MoE)."""

from __future__ import annotations

import pytest
from helpers import TINY_MOE, four_steps_learn, planned, tiny_cfg, tiny_model

from finetune.core.errors import PlanError
from finetune.planner.activations import LayerRun, LayerShape, layer_bytes_per_token


def test_full_fine_tuning_of_qwen3_30b_a3b_is_planned_with_every_expert_trained():
    _, plan = planned("model=qwen3_30b_a3b", "method=full", "hardware=auto")
    assert plan.params_trainable == plan.params_total == 30_532_122_624
    assert plan.fits and plan.hardware.name == "h100x8" and plan.strategy.sharding != "none"
    # weights, gradients and AdamW's two fp32 states for all 30.5B parameters, sharded over the 8 GPUs
    _, lora = planned("model=qwen3_30b_a3b", "method=lora", "hardware=h100x8")
    assert plan.gpu_memory.trainable_state > 30 * lora.gpu_memory.trainable_state


def test_the_full_sparse_layer_keeps_what_expert_lora_keeps_on_the_routed_copies():
    """bf16: the k copies keep (2h + 4I) each, as with LoRA on the experts; under autocast fp32 (grouped_mm of
    fp32 experts runs outside autocast): the measured rows of activations.json, per token."""
    dims = dict(
        hidden=256, intermediate=128, heads=4, kv_heads=2, head_dim=64, experts=8, experts_per_token=2
    )
    qwen = LayerShape(**dims, qk_norm=True)
    assert layer_bytes_per_token(qwen, LayerRun(method="full")) == 12_180
    assert layer_bytes_per_token(qwen, LayerRun(method="full", autocast=True)) == 18_324
    mixtral = LayerShape(**dims, renormalized_routing=True, fp32_routing_weights=True)
    assert layer_bytes_per_token(mixtral, LayerRun(method="full", dtype_bytes=4)) == 17_548


def test_qlora_of_a_mixture_of_experts_is_refused_with_the_real_split():
    with pytest.raises(PlanError) as err:
        planned("model=mixtral_8x7b", "method=qlora", "hardware=h100")
    line = str(err.value)
    assert (
        "1,342,177,280 attention weights would be 4-bit" in line and "45,097,156,608 (96.6% of all)" in line
    )
    assert "saving 2.2% of the weights' memory (use method=lora)" in line and "\n" not in line


def test_bitsandbytes_leaves_the_fused_experts_and_the_router_in_16_bits(tiny_cache):
    """What the refusal rests on: transformers' 4-bit loading of the tiny Qwen3-MoE makes attention 4-bit only."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.modeling import tiny

    m = tiny_model("qwen3_moe", num_experts=4, num_experts_per_token=2, moe_intermediate_size=48)
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny.model_dir(m), quantization_config=quant, dtype=torch.bfloat16, device_map={"": "cpu"}
    )
    packed = {n: p for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)}
    assert {n.split(".")[-2] for n in packed} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert sum(p.numel() for p in packed.values()) == 2 * (2 * 64 * 64 + 2 * 64 * 32) // 2  # uint8: 2 a byte
    kept = {n: p.dtype for n, p in model.named_parameters() if "mlp" in n}
    assert set(kept.values()) == {torch.bfloat16} and len(kept) == 2 * 3  # gate_up, down, router per layer
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if "experts" in n)
    assert experts == 2 * 4 * 3 * 64 * 48 * 2 == 147_456  # bytes, in bf16


@pytest.mark.slow
def test_tiny_qwen3_moe_trains_fully(tmp_path, tiny_cache, tiny_data):
    metrics = four_steps_learn(tmp_path, tiny_data, *TINY_MOE, "method=full", learning_rate="1e-3")
    train = metrics["train"]
    assert train["trainable_parameters"] == train["total_parameters"] == cfg_total(tiny_cfg(*TINY_MOE))
    assert train["router_aux_loss_coef"] == 0.001 and train["final_aux_loss"] > 1.0


def cfg_total(cfg) -> int:
    from finetune.planner.params import count_params

    return count_params(cfg.model).total
