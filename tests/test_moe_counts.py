"""Mixtures of experts counted exactly (total and active a token), against hand counts and transformers'
own classes; the planner refuses those it does not model (here: dense layers interleaved), in one line with both
counts (tests/test_moe_plan.py plans Qwen3-30B-A3B)."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.core.config import ModelConfig
from finetune.modeling.resolve import model_from_config_json
from finetune.planner.params import count_params

# small configs of each style: Mixtral (every layer sparse), Qwen3-MoE (q/k norms, dense layers
# interleaved by mlp_only_layers and decoder_sparse_step), Qwen2-MoE (a shared expert with its gate)
H, V, L, HEADS, KV, D = 64, 512, 4, 4, 2, 16
COMMON = dict(
    hidden_size=H, vocab_size=V, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=KV,
    head_dim=D, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
CONFIGS = {
    "mixtral": dict(COMMON, model_type="mixtral", intermediate_size=96, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(
        COMMON, model_type="qwen3_moe", intermediate_size=160, moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
    ),
    "qwen2_moe": dict(
        COMMON, model_type="qwen2_moe", intermediate_size=160, moe_intermediate_size=48, num_experts=6,
        num_experts_per_tok=2, shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[0],
    ),
}  # fmt: skip
ATTN = H * HEADS * D * 2 + 2 * H * KV * D  # q, o; k, v
EMB = 2 * V * H + H  # embedding, untied head, final norm


def _hand(style: str) -> tuple[int, int]:
    """(total, active a token), counted by hand from the module list of each class."""
    norms = 2 * H
    if style == "mixtral":
        expert, router = 3 * H * 96, 8 * H
        layer = ATTN + norms + 8 * expert + router
        return EMB + L * layer, EMB + L * (layer - 6 * expert)
    if style == "qwen3_moe":
        # sparse layers: (i + 1) % 2 == 0 and i not in [3] -> layer 1 only; layers 0, 2, 3 dense
        expert, router, dense = 3 * H * 48, 8 * H, 3 * H * 160
        base = ATTN + norms + 2 * D  # q_norm, k_norm
        sparse = base + 8 * expert + router
        return EMB + sparse + 3 * (base + dense), EMB + sparse - 6 * expert + 3 * (base + dense)
    expert, router, dense = 3 * H * 48, 6 * H, 3 * H * 160
    bias = HEADS * D + 2 * KV * D
    shared = 3 * H * 128 + H  # the shared expert and its sigmoid gate
    base = ATTN + norms + bias
    sparse = base + 6 * expert + router + shared
    return EMB + 3 * sparse + (base + dense), EMB + 3 * (sparse - 4 * expert) + (base + dense)


def _read(tmp_path, style: str) -> ModelConfig:
    path = tmp_path / style / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CONFIGS[style]))
    return model_from_config_json(ModelConfig(config_path=str(path)))


@pytest.mark.parametrize("style", CONFIGS)
def test_counts_match_hand_counts_and_the_real_class(tmp_path, style):
    m = _read(tmp_path, style)
    counts = count_params(m)
    total, active = _hand(style)
    assert (counts.total, counts.active) == (total, active)
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(str(tmp_path / style))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == total
    if style == "qwen3_moe":  # the experts are fused 3-D parameters
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if "layers.1.mlp" in n}
        assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (8, 2 * 48, H)
        assert shapes["model.layers.1.mlp.experts.down_proj"] == (8, H, 48)


def test_real_sizes_mixtral_and_qwen3_30b_a3b():
    """Mixtral-8x7B and Qwen3-30B-A3B from their published config.json facts."""
    mixtral = ModelConfig(
        architecture="mixtral", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=32000, num_experts=8, num_experts_per_token=2,
    )  # fmt: skip
    c = count_params(mixtral)
    assert (c.total, c.active) == (46_702_792_704, 12_879_925_248)
    qwen = ModelConfig(
        architecture="qwen3_moe", hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        intermediate_size=6144, vocab_size=151936, num_experts=128, num_experts_per_token=8,
        moe_intermediate_size=768,
    )  # fmt: skip
    c = count_params(qwen)
    assert (c.total, c.active) == (30_532_122_624, 3_353_032_704)


def test_the_planner_refuses_them_in_one_line_with_both_counts(tmp_path):
    from finetune.core.errors import PlanError
    from finetune.planner.search import check_model

    m = _read(tmp_path, "qwen3_moe")
    total, active = _hand("qwen3_moe")
    with pytest.raises(PlanError) as err:
        check_model(m)
    assert f"{total:,} parameters, {active:,} active a token" in str(err.value)
    assert "\n" not in str(err.value) and err.value.exit_code == 2
