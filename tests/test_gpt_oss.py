"""gpt-oss: its published parameter counts, its config.json read through transformers' GptOssConfig, LoRA planned
on one GPU with its attention path and its MXFP4 experts counted dequantized, and a tiny gpt-oss (transformers'
own class, random init) trained with LoRA on the CPU."""

from __future__ import annotations

import pytest
from helpers import adapter_weights, four_steps_learn, planned

from finetune.core.composition import compose
from finetune.planner.params import count_params

# gpt-oss-20b, per layer: q/o 2880 x 4096, k/v 2880 x 512, their biases (4096 + 2 x 512 + 2880), 64 sinks, two
# norms; 32 experts of gate_up 2880 x 5760 and down 2880 x 2880 with their biases (5760 + 2880); the router
# (32 x 2880 and 32 biases); the untied embedding and head (201088 x 2880) and the final norm.
ATTENTION = 2 * 2880 * 4096 + 2 * 2880 * 512 + (4096 + 2 * 512 + 2880) + 64 + 2 * 2880
EXPERT = 2880 * 5760 + 2880 * 2880 + 5760 + 2880
ROUTER = 2880 + 1  # a weight row and a bias per expert
OUTSIDE = 2 * 201088 * 2880 + 2880


def _total(layers: int, experts: int) -> int:
    return layers * (ATTENTION + experts * (EXPERT + ROUTER)) + OUTSIDE


def _active(layers: int, experts: int) -> int:
    return layers * (ATTENTION + 4 * EXPERT + experts * ROUTER) + OUTSIDE


@pytest.mark.parametrize(
    "name,layers,experts,total,active",
    [
        ("gpt_oss_20b", 24, 32, 20_914_757_184, 4_187_440_704),
        ("gpt_oss_120b", 36, 128, 116_829_156_672, 5_711_982_912),
    ],
)
def test_published_counts(name, layers, experts, total, active):
    counts = count_params(compose([f"model={name}"]).model)
    assert counts.total == _total(layers, experts) == total
    assert counts.active == _active(layers, experts) == active
    # OpenAI's active sizes (3.6B, 5.1B) leave out the input embedding, a lookup
    assert round((counts.active - counts.embedding) / 1e8) == {"gpt_oss_20b": 36, "gpt_oss_120b": 51}[name]


def test_config_json_reads_as_the_preset(tmp_path):
    from transformers import GptOssConfig

    # the published config.json's facts (the class's defaults are gpt-oss-120b's; 20b differs in these two)
    GptOssConfig(num_hidden_layers=24, num_local_experts=32).save_pretrained(tmp_path)
    _, from_file = planned(f"model.config_path={tmp_path / 'config.json'}", "method=lora", "hardware=h100")
    _, preset = planned("model=gpt_oss_20b", "method=lora", "hardware=h100")
    assert (from_file.params_total, from_file.params_active) == (20_914_757_184, 4_187_440_704)
    assert from_file.params_trainable == preset.params_trainable


def test_lora_recipe_plans_on_one_h100_with_its_attention_and_dequantized_experts():
    cfg, plan = planned("+recipe=gpt_oss_20b_lora")
    assert plan.fits and plan.hardware.name == "h100" and plan.seq_len == 4096
    # LoRA r16 on q/k/v/o of 24 layers
    assert plan.params_trainable == 24 * 16 * ((2880 + 4096) + 2 * (2880 + 512) + (4096 + 2880))
    # no SDPA for gpt-oss in transformers (its sinks): FlexAttention on CUDA, eager on the CPU
    assert plan.strategy.attention == "flex"
    assert (
        "attention: FlexAttention (a block mask from the packed rows' position_ids, no [T, T] tensor) "
        in (" ".join(plan.reasons) + " ")
    )
    # the experts are counted dequantized: every weight in bf16
    experts = 24 * 32 * 3 * 2880 * 2880
    assert plan.gpu_memory.weights * 1e9 == pytest.approx(2 * plan.params_total)
    line = next(r for r in plan.reasons if r.startswith("experts: stored as MXFP4"))
    assert f"({experts * 4.25 / 8 / 1e9:,.1f} GB)" in line and f"({2 * experts / 1e9:,.1f} GB," in line
    assert line.endswith("the weights term counts bf16)")


def test_sliding_layers_block_mask_is_bounded_by_the_window():
    from finetune.planner.attention import block_mask_bytes

    _, plan = planned("+recipe=gpt_oss_20b_lora", "train.seq_len=131072", "hardware=h200")
    full = block_mask_bytes(tokens=131_072, rows=plan.strategy.micro_batch_size)
    # the sliding layers' mask: 1,024 query blocks x 2 key blocks (128-token window) each
    sliding = plan.strategy.micro_batch_size * 4 * 4 * 1024 * 2
    assert plan.strategy.attention == "flex" and plan.strategy.sequence_parallel == 1
    assert plan.gpu_memory.attention * 1e9 == pytest.approx(full + sliding)


def test_cpu_runs_eager_attention_and_counts_its_scores():
    tiny = ("model.architecture=gpt_oss", "model.num_experts=4", "model.num_experts_per_token=2",
            "model.intermediate_size=48", "model.attention_bias=true")  # fmt: skip
    cfg, plan = planned(*tiny, "train.seq_len=128", "train.activation_checkpointing=false")
    s = plan.strategy
    assert s.attention == "eager"
    # every layer's softmax output over T + 1 columns (the sink), 4 heads, fp32 or bf16 as the plan computes
    scores = 2 * s.micro_batch_size * 4 * 128 * 129
    assert plan.gpu_memory.attention * 1e9 >= scores * (2 if cfg.method.precision == "bf16" else 4) - 1


@pytest.mark.slow
def test_tiny_gpt_oss_trains_with_lora_on_attention(tmp_path, tiny_cache, tiny_data):
    metrics = four_steps_learn(
        tmp_path,
        tiny_data,
        "model.architecture=gpt_oss",
        "model.num_experts=4",
        "model.num_experts_per_token=2",
        "model.intermediate_size=48",
        "model.attention_bias=true",
        "method=lora",
        "method.lora_dropout=0",
    )
    assert metrics["eval"]["trained"]["loss"] < metrics["eval"]["base"]["loss"]
    names = adapter_weights(tmp_path / "run")
    adapted = {n.split(".")[-3] for n in names if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not any("experts" in n or "router" in n for n in names)
    layers = compose([]).model.num_layers
    assert len([n for n in names if "lora_A" in n]) == 4 * layers  # every layer's four projections
