"""gpt-oss's MXFP4 experts: the plan counts them dequantized to bf16 and says so in one line, and training loads a
checkpoint that stores them in MXFP4 dequantized (transformers' MXFP4 quantizer does not train, and keeps them
packed wherever its Triton kernels are installed)."""

from __future__ import annotations

import json

import pytest
from helpers import planned

from finetune.core.composition import compose
from finetune.modeling.loading import dequantized_experts


def _checkpoint_config(folder, quantization):
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    config.save_pretrained(folder)
    if quantization is not None:  # as the published checkpoints write it
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": quantization}))


def test_an_mxfp4_checkpoint_loads_its_experts_dequantized(tmp_path):
    from transformers.utils.quantization_config import Mxfp4Config

    _checkpoint_config(
        tmp_path, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    )
    kwargs = dequantized_experts(compose(["model=gpt_oss_20b"]).model, str(tmp_path))
    assert list(kwargs) == ["quantization_config"]
    config = kwargs["quantization_config"]
    assert isinstance(config, Mxfp4Config) and config.dequantize is True


def test_a_bf16_checkpoint_and_other_families_load_as_they_are(tmp_path):
    _checkpoint_config(tmp_path, None)
    assert dequantized_experts(compose(["model=gpt_oss_20b"]).model, str(tmp_path)) == {}
    # a family without quantized experts reads nothing (the folder does not exist)
    assert dequantized_experts(compose(["model=llama3_1_8b"]).model, str(tmp_path / "absent")) == {}


@pytest.mark.parametrize("name,layers,experts", [("gpt_oss_20b", 24, 32), ("gpt_oss_120b", 36, 128)])
def test_the_plan_counts_the_dequantized_bf16_experts_and_says_what_they_cost(name, layers, experts):
    _, plan = planned(f"model={name}", "method=lora", "hardware=h200", "train.seq_len=4096")
    weights = layers * experts * 3 * 2880 * 2880
    stored, bf16 = weights * 4.25 / 8 / 1e9, 2 * weights / 1e9
    line = next(r for r in plan.reasons if r.startswith("experts: stored as MXFP4"))
    assert line == (
        f"experts: stored as MXFP4 in the checkpoint ({stored:,.1f} GB), which transformers does not train: "
        f"dequantized to bf16 when loaded ({bf16:,.1f} GB, {bf16 - stored:,.1f} GB more; the weights term counts bf16)"
    )
    # every weight in bf16, the experts included
    assert plan.gpu_memory.weights * 1e9 == pytest.approx(2 * plan.params_total)
