"""A tiny Qwen3-MoE (transformers' own class, fused 3-D experts) trains with LoRA in one process: on
attention, and on the experts through PEFT's target_parameters, in bf16 and fp32; the held-out loss falls."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers import last_losses, tiny_cfg, train_run

TINY_MOE = (
    "model.architecture=qwen3_moe",
    "model.num_experts=4",
    "model.num_experts_per_token=2",
    "model.moe_intermediate_size=48",
)


@pytest.mark.slow
@pytest.mark.parametrize("precision,experts", [("bf16", True), ("fp32", True), ("bf16", False)])
def test_tiny_qwen3_moe_trains_with_lora(tmp_path, tiny_cache, tiny_data, precision, experts):
    extra = ("method.lora_dropout=0", "method.lora_experts=true") if experts else ()
    cfg = tiny_cfg(
        *TINY_MOE,
        "method=lora",
        *extra,
        f"method.precision={precision}",
        "method.learning_rate=3e-3",
        "train.max_steps=4",
        "train.save_steps=1000",
        "train.warmup_ratio=0.0",
        run_dir=tmp_path / "run",
    )
    metrics = train_run(
        cfg, tiny_data, n_train=8, n_eval=8, max_generate=2, micro_batch_size=2, grad_accum_steps=1
    )
    losses = last_losses(Path(metrics["train"]["output_dir"]).parent)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    base, trained = metrics["eval"]["base"]["loss"], metrics["eval"]["trained"]["loss"]
    assert trained < base - 0.1, (base, trained)
