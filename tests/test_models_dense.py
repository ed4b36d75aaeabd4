"""Qwen3, Gemma 3 and Phi-3/4: counted exactly, their layers' saved bytes as measured, planned, trained.

Each family's facts are fields of finetune/core/architectures.py (q/k norms, four norms, fused
projections); nothing here compares family names beyond choosing the case.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import REPO, four_steps_learn, planned, script_module, tiny_model

from finetune.core.config import MethodConfig, ModelConfig
from finetune.core.errors import ConfigError
from finetune.modeling import tiny
from finetune.modeling.resolve import model_from_config_json
from finetune.planner.params import count_params, lora_params

FAMILIES = {"qwen3_8b": "qwen3", "gemma3_12b": "gemma3_text", "phi4": "phi3"}
# the exact counts of the real models' text decoders (transformers' own classes agree: below)
TOTALS = {"qwen3_8b": 8_190_735_360, "gemma3_12b": 11_766_034_176, "phi4": 14_659_507_200}


def _model(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text()))


def _tiny(architecture: str) -> ModelConfig:
    """The tiny model's shape in another family's class (tests/helpers.py)."""
    return tiny_model(architecture)


@pytest.mark.parametrize("name", FAMILIES)
def test_full_size_counts_match_transformers_class(name):
    """The model config's count equals the parameters of transformers' own class built from it (on meta)."""
    m = _model(name)
    assert m.architecture == FAMILIES[name]
    assert count_params(m).total == TOTALS[name]
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny.hf_config(m))
    assert model.config.model_type == m.architecture
    assert sum(p.numel() for p in model.parameters()) == TOTALS[name]


@pytest.mark.parametrize("architecture", FAMILIES.values())
def test_tiny_model_of_each_class_counts_exactly(tiny_cache, architecture):
    m = _tiny(architecture)
    model = tiny.load_model(m)
    assert model.config.model_type == architecture
    assert sum(p.numel() for p in model.parameters()) == count_params(m).total
    # LoRA's count: PEFT's own adapters on every projection the architecture names
    from peft import LoraConfig, get_peft_model

    from finetune.core.architectures import ARCHITECTURES

    targets = list(ARCHITECTURES[architecture].projections)
    peft = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    method = MethodConfig(name="lora", lora_rank=8, target_modules=targets)
    assert trainable == lora_params(m, method)


def test_phi_fused_adapters_are_counted_as_fused():
    """qkv_proj's adapter is r x (h + q + 2kv), not three adapters' r x (3h + q + 2kv): Phi-4 at r=16."""
    m = _model("phi4")
    method = MethodConfig(
        name="lora", lora_rank=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    )
    h, q, kv, i = 5120, 5120, 1280, 17920
    per_layer = 16 * ((h + q + 2 * kv) + (q + h) + (h + 2 * i) + (i + h))
    assert lora_params(m, method) == 40 * per_layer == 55_705_600
    with pytest.raises(ConfigError, match="method.target_modules has q_proj.*qkv_proj"):
        lora_params(m, MethodConfig(name="lora", target_modules=["q_proj"]))


@pytest.mark.parametrize("name", FAMILIES)
def test_config_json_of_each_family_reads_back(tmp_path, name):
    """A config.json as the hub ships it (transformers' own serialization) is read, not refused."""
    m = _model(name)
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    tiny.hf_config(m).to_json_file(str(path))
    read = model_from_config_json(ModelConfig(config_path=str(path)))
    fields = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    assert all(getattr(read, f) == getattr(m, f) for f in fields)
    assert (read.intermediate_size, read.vocab_size, read.tie_embeddings) == (
        m.intermediate_size,
        m.vocab_size,
        m.tie_embeddings,
    )
    assert count_params(read).total == TOTALS[name]


def test_unmodelled_option_is_refused_in_one_line(tmp_path):
    """Phi-4-mini's partial rotary was never measured: refused naming the key, not planned as if full."""
    m = _tiny("phi3")
    path = tmp_path / "config.json"
    tiny.hf_config(m, partial_rotary_factor=0.75).to_json_file(str(path))
    with pytest.raises(ConfigError) as err:
        model_from_config_json(ModelConfig(config_path=str(path)))
    assert "\n" not in str(err.value) and "partial_rotary_factor=0.75" in str(err.value)
    assert err.value.exit_code == 2


@pytest.mark.parametrize(
    "name,hardware,extra",
    [("qwen3_8b", "h100", ()), ("gemma3_12b", "h100", ()), ("phi4", "h100", ())],
)
def test_each_family_is_planned(name, hardware, extra):
    """LoRA on one H100: a plan that fits, counted with the family's parameters and adapters."""
    cfg, plan = planned(f"model={name}", "method=lora", f"hardware={hardware}", *extra)
    assert plan.params_total == TOTALS[name]
    assert plan.params_trainable == lora_params(cfg.model, cfg.method)
    assert plan.fits


def test_stored_family_measurements_cover_every_family_and_case():
    rows = json.loads((REPO / "finetune" / "planner" / "activations.json").read_text())["measurements"]
    rows = [r for r in rows if "experts" not in r]  # the sparse layers' rows: tests/test_activations.py
    script = script_module("measure_activations")
    seen = {(r["family"], r["case"]) for r in rows if "family" in r}
    assert seen == {(f, c) for f in FAMILIES.values() for c in script.FAMILY_CASES}
    assert {r["shape"] for r in rows if "family" in r} == set(script.FAMILY_SHAPES)
    for r in rows:
        if "family" in r:
            assert script.formula_bytes(r) == r["bytes"], (r["shape"], r["case"])


@pytest.mark.parametrize("case", ["full", "lora_fp32_autocast", "lora_bf16_dropout", "full_autocast"])
@pytest.mark.parametrize("family", FAMILIES.values())
def test_live_measurement_of_each_family_layer(family, case):
    script = script_module("measure_activations")
    shape = (256, 640, 4, 2, 64, False)
    layer = script.build_layer(shape, case, family=family)
    row = dict(family=family, dims=list(shape), case=case, tokens=64)
    assert script.formula_bytes(row) == script.measure_layer(shape, case, 64, layer)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", FAMILIES.values())
def test_tiny_model_of_each_family_trains_in_bf16(tmp_path, tiny_cache, tiny_data, architecture):
    """A few bf16 LoRA steps of the tiny model in the family's own class, through the project's loader."""
    m = _tiny(architecture)
    metrics = four_steps_learn(
        tmp_path,
        tiny_data,
        f"model.architecture={architecture}",
        f"model.hidden_size={m.hidden_size}",
        f"model.num_heads={m.num_heads}",
        f"model.head_dim={m.head_dim}",
        "method=lora",  # its targets: the architecture's own projections (Phi's fused four)
        "method.precision=bf16",
    )
    engine = metrics["train"]["engine"]
    assert engine["mixed_precision"] == "bf16" and engine["parameter_dtypes"] == ["bfloat16", "float32"]
