"""A tiny Qwen3-MoE (transformers' own class, fused 3-D experts) trains with LoRA in one process: on
attention, and on the experts through PEFT's target_parameters, in bf16 and fp32; the held-out loss falls."""

from __future__ import annotations

import json

import pytest
from helpers import TINY_MOE, four_steps_learn, tiny_cfg


@pytest.mark.slow
@pytest.mark.parametrize("precision,experts", [("bf16", True), ("fp32", True), ("bf16", False)])
def test_tiny_qwen3_moe_trains_with_lora(tmp_path, tiny_cache, tiny_data, precision, experts):
    extra = ("method.lora_dropout=0", "method.lora_experts=true") if experts else ()
    four_steps_learn(tmp_path, tiny_data, *TINY_MOE, "method=lora", *extra, f"method.precision={precision}")


@pytest.mark.slow
def test_expert_adapters_merge_and_export_with_the_logit_check(tmp_path, tiny_cache, tiny_data):
    """PEFT's merge folds the expert adapters into the 3-D weights: the merged model's logits match."""
    from dataclasses import replace

    from helpers import make_adapter_run, plan_for
    from safetensors import safe_open

    from finetune.core.config.export import ExportConfig
    from finetune.export import stage as export_stage

    run = tmp_path / "run"
    cfg = tiny_cfg(*TINY_MOE, "method=lora", "method.lora_dropout=0", "method.lora_experts=true", run_dir=run)
    cfg = replace(cfg, export=ExportConfig(evaluate_merged=False))
    make_adapter_run(run, cfg.model, cfg.method)
    with safe_open(str(run / "adapter" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any("mlp.experts" in n for n in names)  # the experts' adapters were saved with the attention ones
    export_stage.run(cfg, run, plan_for(cfg), eval_dataset=tiny_data[1].select(range(12)))
    check = json.loads((run / "export" / "merge_check.json").read_text())
    assert check["ok"] and check["max_abs_diff"] <= check["tolerance"] and check["top1_agreement"] == 1.0
    assert json.loads((run / "export" / "merged" / "config.json").read_text())["model_type"] == "qwen3_moe"
