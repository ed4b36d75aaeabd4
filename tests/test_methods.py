"""A method is one place: finetune/core/methods.py's specs, the configs that name them, and a new method as one entry.

python -m pytest tests/test_methods.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import yaml
from helpers import run_cli

from finetune.core.composition import compose, group_choices, load_profiles, package_dir
from finetune.core.config import Config, MethodConfig
from finetune.core.errors import ConfigError
from finetune.core.methods import MERGES, METHODS, MethodSpec
from finetune.planner import Plan, Strategy, make_plan, model_flops_per_token, why_not

PROFILES = load_profiles()


def plan_for(*overrides: str) -> tuple[Config, Plan]:
    cfg = compose(["mode=plan", *overrides])
    return cfg, make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)


# ---------------------------------------------------------------- the three specs


def test_full_fine_tuning_spec():
    full = METHODS["full"]
    assert (full.trains_base_weights, full.adapters, full.quantized_base) == (True, False, False)
    assert full.flops_per_weight == 6.0
    assert full.merge == "cast" and not full.serve_adapter and full.can_shard and full.shard_refusal is None
    assert (full.fallback, full.fallback_settings) == ("lora", (("optimizer", None),))
    assert full.lora_options == ()


def test_lora_spec():
    lora = METHODS["lora"]
    assert (lora.trains_base_weights, lora.adapters, lora.quantized_base) == (False, True, False)
    assert lora.flops_per_weight == 4.0
    assert lora.merge == "adapter" and lora.serve_adapter and lora.can_shard
    assert (lora.fallback, lora.fallback_settings) == ("qlora", (("adapter_dtype", "bf16"),))
    assert lora.lora_options == ()


def test_qlora_spec():
    qlora = METHODS["qlora"]
    assert (qlora.trains_base_weights, qlora.adapters, qlora.quantized_base) == (False, True, True)
    assert qlora.flops_per_weight == 4.0
    assert qlora.merge == "adapter_quantized_base" and qlora.serve_adapter
    # packed in the training dtype, FSDP2 and ZeRO-3 divide its 4-bit weights (tests/test_qlora_sharded.py)
    assert qlora.can_shard and qlora.shard_refusal is None
    assert (qlora.fallback, qlora.fallback_settings) == (None, ())


def test_every_spec_is_named_by_its_key_and_described_in_one_line():
    assert list(METHODS) == ["full", "lora", "qlora"]  # the order config errors list them in
    for name, spec in METHODS.items():
        assert spec.name == name
        assert spec.description and "\n" not in spec.description
        assert spec.fallback is None or spec.fallback in METHODS
        assert spec.merge in MERGES


def test_a_spec_that_contradicts_itself_is_refused():
    with pytest.raises(ValueError, match="merge='cast' contradicts adapters=True"):
        replace(METHODS["lora"], merge="cast")
    with pytest.raises(
        ValueError, match="merge='squash' is not one of cast, adapter, adapter_quantized_base"
    ):
        replace(METHODS["lora"], merge="squash")
    with pytest.raises(ValueError, match="exactly one of the base weights or adapters trains"):
        replace(METHODS["full"], adapters=True, merge="adapter")
    with pytest.raises(ValueError, match="serve_adapter needs adapters"):
        replace(METHODS["full"], serve_adapter=True)


# ---------------------------------------------------------------- the configs name exactly the specs


def test_every_method_config_has_a_spec_and_every_spec_a_config():
    folder = package_dir("configs") / "method"
    files = {p.stem: yaml.safe_load(p.read_text()) for p in folder.glob("*.yaml")}
    assert set(files) == set(METHODS) == set(group_choices("method"))
    for stem, raw in files.items():
        assert raw["name"] == stem
        assert compose([f"method={stem}"]).method.spec is METHODS[stem]


def test_method_config_reads_its_spec():
    assert MethodConfig(name="full").uses_adapters is False
    assert MethodConfig(name="lora").uses_adapters is True
    assert MethodConfig(name="qlora").spec.quantized_base is True


def test_unknown_method_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as err:
        MethodConfig(name="dora")
    assert str(err.value) == "method.name='dora' is not one of full, lora, qlora"
    with pytest.raises(ConfigError, match="method.name='dora' is not one of full, lora, qlora"):
        compose(["method.name=dora"])


def test_unknown_method_exits_2_with_one_line(tmp_path):
    proc = run_cli("mode=plan", "method.name=dora", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "finetune: error: method.name='dora' is not one of full, lora, qlora"
    )


def test_adapter_keys_are_checked_only_for_adapter_methods():
    with pytest.raises(ConfigError, match=r"method.lora_dropout=1.5 must be in \[0, 1\)"):
        MethodConfig(name="lora", lora_dropout=1.5)
    assert MethodConfig(name="full", lora_dropout=1.5).lora_dropout == 1.5  # not an adapter method: unused


# ---------------------------------------------------------------- the planner reads the facts


@pytest.mark.parametrize("sharding", ["none", "ddp", "fsdp", "zero3"])
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_every_method_runs_under_every_engine(method: str, sharding: str):
    assert why_not(Strategy(sharding=sharding), method, gpus=8) is None


@pytest.fixture
def unshardable() -> Iterator[MethodSpec]:
    """A method whose spec refuses sharding, registered for the test and removed after."""
    spec = replace(METHODS["qlora"], name="unshardable_test", shard_refusal="its weights cannot be divided")
    METHODS[spec.name] = spec
    try:
        yield spec
    finally:
        del METHODS[spec.name]


@pytest.mark.parametrize("sharding", ["fsdp", "zero3"])
def test_sharding_refusal_comes_from_the_spec(unshardable: MethodSpec, sharding: str):
    reason = why_not(Strategy(sharding=sharding), unshardable.name, gpus=8)
    assert reason == (
        f"method=unshardable_test does not shard under train.sharding={sharding}: its weights cannot be divided"
    )
    assert why_not(Strategy(sharding="ddp"), unshardable.name, gpus=8) is None


def test_flops_per_weight_come_from_the_spec():
    m = compose(["model=llama3_1_8b"]).model
    full, lora, qlora = (model_flops_per_token(m, name, 4096) for name in ("full", "lora", "qlora"))
    assert lora == qlora
    # the matmul part scales 6:4; attention (6 x layers x seq x heads x head_dim) is the same for both
    attention = 6.0 * m.num_layers * 4096 * m.num_heads * m.head_dim
    assert (full - attention) / (lora - attention) == pytest.approx(1.5, rel=1e-12)


def test_fallback_suggestions_come_from_the_spec():
    _, full = plan_for("+recipe=qwen32b_full", "hardware=h200")
    assert not full.fits and "method=lora fits on h200 (91.3 GB per GPU)" in full.suggestions
    _, lora = plan_for("+recipe=llama70b_lora", "hardware=h100")
    assert not lora.fits and "method=qlora fits on h100 (61.6 GB per GPU)" in lora.suggestions


# ---------------------------------------------------------------- a new method is one entry


@pytest.fixture
def dora_test() -> Iterator[MethodSpec]:
    """A hypothetical DoRA: LoRA's facts with PEFT's `use_dora`, registered for the test and removed after."""
    spec = replace(
        METHODS["lora"],
        name="dora_test",
        description="DoRA: weight-decomposed LoRA adapters (test entry)",
        lora_options=(("use_dora", True),),
        serve_adapter=False,  # vLLM serves no DoRA adapter: merged only
        fallback=None,
        fallback_settings=(),
    )
    METHODS["dora_test"] = spec
    try:
        yield spec
    finally:
        del METHODS["dora_test"]


def test_a_registered_method_validates_and_plans_as_its_facts_say(dora_test: MethodSpec):
    cfg, dora = plan_for("+recipe=llama8b_lora", "method.name=dora_test")
    assert cfg.method.spec is dora_test and cfg.method.uses_adapters
    _, lora = plan_for("+recipe=llama8b_lora")
    # the memory model reads only the spec's facts, which are LoRA's
    assert dora.gpu_memory == lora.gpu_memory
    assert dora.strategy == lora.strategy
    assert (dora.params_total, dora.params_trainable) == (lora.params_total, lora.params_trainable)
    assert dora.host_memory_gb == lora.host_memory_gb
    assert dora.merge_host_memory_gb == lora.merge_host_memory_gb
    assert (dora.disk_checkpoint_gb, dora.disk_export_gb) == (lora.disk_checkpoint_gb, lora.disk_export_gb)
    # the utilisation is fitted per method (calibration.json): a new one has no time estimate until measured
    assert lora.estimate.step_seconds is not None and dora.estimate.step_seconds is None
    assert "no time estimate: profile h100 has no fitted utilisation for cuda" in dora.reasons


def test_a_registered_method_is_refused_once_removed():
    assert "dora_test" not in METHODS
    with pytest.raises(ConfigError, match="method.name='dora_test' is not one of full, lora, qlora"):
        MethodConfig(name="dora_test")


def test_a_registered_method_loads_with_its_peft_options(dora_test: MethodSpec, tiny_cache):
    from finetune.modeling.loading import load_for_training

    cfg = compose(["method.name=dora_test"])
    model, _ = load_for_training(cfg)
    assert model.peft_config["default"].use_dora is True
    magnitudes = [n for n, _ in model.named_parameters() if "lora_magnitude_vector" in n]
    layers = cfg.model.num_layers * len(cfg.method.targets(cfg.model.architecture))
    assert len(magnitudes) == layers  # one DoRA magnitude vector per adapted projection
