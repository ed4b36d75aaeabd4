"""LoRA's target modules follow the architecture's description (finetune/core/architectures.py): Phi-4's
fused qkv_proj / gate_up_proj with no method.target_modules override."""

from __future__ import annotations

import pytest
from helpers import planned, tiny_cfg

from finetune.core.errors import ConfigError
from finetune.planner.params import lora_params

# Phi-4: h 5120, q 40 x 128, kv 10 x 128, I 17920, 40 layers; LoRA r16 on its four fused projections
PHI4_R16 = 16 * 40 * ((5120 + 5120 + 2 * 1280) + (5120 + 5120) + (5120 + 2 * 17920) + (17920 + 5120))


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_phi4_is_planned_on_its_fused_projections_by_default(method):
    cfg, plan = planned("model=phi4", f"method={method}", "hardware=h100")
    assert cfg.method.target_modules is None
    assert cfg.method.targets("phi3") == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert plan.params_trainable == PHI4_R16 == 55_705_600
    assert plan.fits


def test_a_chosen_list_still_wins_and_is_checked():
    _, plan = planned("model=phi4", "method=lora", "hardware=h100", "method.target_modules=[qkv_proj]")
    assert plan.params_trainable == 16 * 40 * (5120 + 5120 + 2 * 1280)
    with pytest.raises(ConfigError, match="method.target_modules has q_proj, which phi3 layers do not have"):
        planned("model=phi4", "method=lora", "hardware=h100", "method.target_modules=[q_proj]")


@pytest.mark.slow  # builds and loads a tiny Phi-3 (about 35 s on a shared core)
def test_the_loader_adapts_a_tiny_phi3s_fused_modules(tiny_cache):
    from finetune.modeling.loading import load_for_training

    cfg = tiny_cfg("model.architecture=phi3", "model.hidden_size=64", "model.head_dim=16", "method=lora")
    m = cfg.model
    model, _ = load_for_training(cfg)
    adapted = sorted({n.split(".")[-4] for n, p in model.named_parameters() if "lora_A" in n})
    assert adapted == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    h, kv, i, r = m.hidden_size, m.num_kv_heads * m.head_dim, m.intermediate_size, cfg.method.lora_rank
    assert trainable == r * m.num_layers * ((h + h + 2 * kv) + (h + h) + (h + 2 * i) + (i + h))
    assert trainable == lora_params(m, cfg.method)
