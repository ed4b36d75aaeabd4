"""Every recipe and every config group composes and validates; bad values fail with the key's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.core.composition import compose, group_choices, load_profiles, package_dir, recipe_names
from finetune.core.config import Config
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES

ROOT = Path(__file__).resolve().parents[1]


def _yaml_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.yaml"))


def test_config_folders_are_walked_recursively():
    # The ConfigStore registers recipes/*.yaml; a nested file would be silently skipped.
    assert all(p.parent == ROOT / "recipes" for p in _yaml_files(ROOT / "recipes"))
    groups = {p.parent.name for p in _yaml_files(ROOT / "configs") if p.parent != ROOT / "configs"}
    assert groups == {
        "model",
        "method",
        "hardware",
        "data",
        "train",
        "plan",
        "launch",
        "eval",
        "export",
        "objective",
        "ui",
    }


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_composes(recipe: str):
    cfg = compose([f"+recipe={recipe}", "mode=plan"])
    assert isinstance(cfg, Config)
    assert cfg.name == recipe
    text = (package_dir("recipes") / f"{recipe}.yaml").read_text()
    assert text.startswith(f"# python -m finetune +recipe={recipe}"), "a recipe starts with its exact command"
    assert len(text.splitlines()) <= 30
    if cfg.model.name in ("llama3_1_70b", "qwen2_5_32b"):
        assert cfg.smoke.sibling in recipe_names() and cfg.smoke.sibling.startswith("llama8b")


@pytest.mark.parametrize(
    "group,option",
    [
        (g, o)
        for g in ("model", "method", "hardware", "data", "train", "plan", "launch", "eval", "export", "ui")
        for o in group_choices(g)
    ],
)
def test_every_group_option_composes(group: str, option: str):
    cfg = compose([f"{group}={option}", "mode=plan"])
    assert getattr(cfg, group).__class__.__name__.endswith("Config")
    if group in ("model", "method", "hardware"):
        assert getattr(cfg, group).name == option


def test_stable_names():
    assert set(recipe_names()) == {
        "tiny", "llama8b_lora", "llama8b_lora_128k", "llama8b_qlora", "llama70b_qlora", "llama70b_lora",
        "llama70b_full", "qwen32b_lora", "qwen32b_full", "tiny_dpo", "llama8b_dpo", "llama70b_qlora_dpo",
        "tiny_grpo", "llama8b_grpo", "tiny_reward", "llama8b_reward", "llama8b_grpo_8gpu", "smollm2_135m_lora", "smollm2_135m_dpo", "tiny_moe", "qwen3_30b_a3b_lora",
        "tiny_mixtral", "mixtral_8x7b_lora", "gpt_oss_20b_lora", "tiny_rloo", "llama8b_rloo", "tiny_vlm", "qwen25vl_7b_lora",
        "tiny_distill", "tiny_distill_onpolicy", "llama8b_distill", "tiny_kto", "llama8b_kto", "tiny_orpo", "tiny_simpo", "llama8b_orpo", "llama8b_simpo",
    }  # fmt: skip
    assert set(group_choices("model")) == {
        "tiny",
        "smollm2_135m",
        "llama3_2_3b",
        "llama3_1_8b",
        "qwen2_5_32b",
        "llama3_1_70b",
        "llama3_1_405b",
        "llama2_7b",
        "llama2_70b",
        "qwen3_8b",
        "gemma3_12b",
        "phi4",
        "qwen3_30b_a3b",
        "mixtral_8x7b",
        "gpt_oss_20b",
        "gpt_oss_120b",
        "qwen2_5_vl_7b",
        "smolvlm2_500m",
        "gemma3_12b_vision",
        "qwen3_vl_8b",
    }
    assert set(group_choices("method")) == {"full", "lora", "qlora"}
    assert set(group_choices("objective")) == set(OBJECTIVES)
    assert set(group_choices("hardware")) == {
        "cpu", "h100", "h200", "b200", "b300", "h100x8", "h200x8", "b200x8", "b300x8", "auto", "local",
        "a100_40gb", "a100_80gb", "a100_40gbx8", "a100_80gbx8", "l40s", "l40sx8", "h100_nvl",
        "gh200_96gb", "gh200_144gb", "rtx4090", "l4", "a10gx4", "rtx3090", "rtx5090", "rtx_a6000", "l40",
        "rtx_pro_6000", "custom",
    }  # fmt: skip


def test_embedded_default_is_the_tiny_recipe():
    cfg = compose([])
    assert (cfg.name, cfg.model.name, cfg.method.name, cfg.hardware.name) == ("tiny", "tiny", "lora", "cpu")
    assert cfg.mode == "all"


def test_groups_without_recipe_do_not_inherit_tiny_values():
    cfg = compose(["model=llama3_1_8b", "method=full"])
    assert cfg.name == "llama3_1_8b_full"
    assert cfg.method.learning_rate == 1e-5
    assert cfg.method.dtype_on("cuda") == "bf16" and cfg.method.dtype_on("cpu") == "fp32"


def test_command_line_beats_recipe():
    cfg = compose(
        ["+recipe=llama70b_qlora", "hardware=h200", "train.seq_len=4096", "smoke=true", "smoke.steps=7"]
    )
    assert cfg.hardware.name == "h200" and cfg.train.seq_len == 4096
    assert cfg.smoke.enabled and cfg.smoke.steps == 7 and cfg.smoke.sibling == "llama8b_qlora"


def test_method_defaults():
    lora = compose(["model=tiny", "method=lora"]).method  # a model chosen: the groups alone, no recipe
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_dropout) == (16, 32, 0.05)
    assert lora.target_modules is None  # every projection of the model's architecture
    assert lora.targets("llama") == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    q = compose(["model=tiny", "method=qlora"]).method
    assert (q.quant_type, q.double_quant, q.compute_dtype, q.adapter_dtype) == ("nf4", True, "auto", "bf16")
    assert compose(["model=tiny"]).plan.mfu is None  # the planner's per-method figure, fitted to GPU runs
    assert q.quant_compute_dtype_on("cuda") == "bf16" and q.quant_compute_dtype_on("cpu") == "fp32"
    assert compose(["model=tiny", "method=full"]).method.optimizer is None


def test_a_group_alone_runs_the_embedded_default_there():
    """`python -m finetune hardware=h200` (or method=qlora) runs the tiny recipe there; precision follows the device."""
    on_gpu = compose(["hardware=h200"])
    assert (on_gpu.name, on_gpu.model.name, on_gpu.train.seq_len, on_gpu.hardware.name) == (
        "tiny",
        "tiny",
        256,
        "h200",
    )
    assert on_gpu.method.dtype_on(on_gpu.hardware.device) == "bf16"
    assert compose([]).method.dtype_on("cpu") == "fp32"
    qlora = compose(["method=qlora"])
    assert (qlora.name, qlora.method.name, qlora.method.lora_rank) == ("tiny", "qlora", 32)
    assert compose(["model=llama3_1_8b", "hardware=h200"]).name == "llama3_1_8b_lora"  # groups only


def test_hardware_facts_match_design():
    facts = {  # name: (gpus, GB per GPU, host GB, USD/month)
        "h100": (1, 80, 225, 2190), "h200": (1, 141, 240, 3090), "b200": (1, 180, 256, 4590),
        "b300": (1, 288, None, 5190), "h100x8": (8, 80, 2000, 16900), "h200x8": (8, 141, 2000, 23900),
        "b200x8": (8, 180, 2000, 34900), "b300x8": (8, 288, 2000, 39900),
    }  # fmt: skip
    for name, (gpus, gb, host, usd) in facts.items():
        hw = compose([f"hardware={name}"]).hardware
        assert (hw.total_gpus, hw.gpu_memory_gb, hw.host_memory_gb, hw.usd_per_month) == (gpus, gb, host, usd)
        assert hw.peak_bf16_tflops == (989 if name.startswith("h") else 2250)


def test_rented_profiles_carry_datasheet_facts_and_no_invented_ones():
    facts = {  # name: (gpus, GB per GPU, memory TB/s, dense bf16 TFLOP/s, interconnect); price unknown
        "a100_40gb": (1, 40, 1.555, 312, None), "a100_80gb": (1, 80, 2.039, 312, None),
        "a100_40gbx8": (8, 40, 1.555, 312, "nvlink"), "a100_80gbx8": (8, 80, 2.039, 312, "nvlink"),
        "l40s": (1, 48, 0.864, 362, None), "l40sx8": (8, 48, 0.864, 362, "pcie"),
        "h100_nvl": (1, 94, 3.9, None, None), "gh200_96gb": (1, 96, 4.0, None, None),
        "gh200_144gb": (1, 144, None, None, None),
    }  # fmt: skip
    for name, (gpus, gb, tb_s, tflops, link) in facts.items():
        hw = compose([f"hardware={name}"]).hardware
        assert (hw.total_gpus, hw.gpu_memory_gb, hw.hbm_tb_per_s) == (gpus, gb, tb_s), name
        assert (hw.peak_bf16_tflops, hw.interconnect) == (tflops, link), name
        assert hw.usd_per_month is None and hw.host_memory_gb is None and len(hw.gpu_names) == 1, name


@pytest.mark.parametrize(
    "name", [n for n in group_choices("hardware") if n not in ("auto", "cpu", "local", "custom")]
)
def test_every_gpu_profile_plans(name: str):
    from finetune.planner import make_plan

    cfg = compose(["model=llama3_1_8b", "method=qlora", f"hardware={name}", "train.seq_len=2048"])
    plan = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, load_profiles())
    assert (
        plan.fits
        and plan.hardware.name == name
        and plan.to_dict()["hardware"]["gpus"] == cfg.hardware.total_gpus
    )
    assert (plan.estimate.tokens_per_second is None) == (cfg.hardware.peak_bf16_tflops is None)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.seq_len=0"], "train.seq_len=0 must be > 0"),
        (["train.seq_len=abc"], "train.seq_len='abc'"),
        (["method.lora_rank=-1"], "method.lora_rank=-1 must be > 0"),
        (["train.batch_size=abc"], "train.batch_size"),
        (["train.foo=1"], "train.foo: unknown key"),
        (["foo=1"], "foo: unknown key"),
        (["+foo=1"], "foo: unknown key"),
        (
            ["model=gpt5"],
            "model=gpt5: unknown model; choose from gemma3_12b, gemma3_12b_vision, gpt_oss_120b, gpt_oss_20b",
        ),
        (["method=dora"], "method=dora: unknown method; choose from full, lora, qlora"),
        (["hardware=tpu"], "hardware=tpu: unknown hardware; choose from a100_40gb"),
        (["+recipe=nope"], "recipe=nope: unknown recipe; choose from gpt_oss_20b_lora, llama70b_full"),
        (["mode=fly"], "mode='fly' is not one of"),
        (["method.optimizer=sgd"], "method.optimizer='sgd' is not one of adamw"),
        (["smoke=maybe"], "smoke.enabled"),
        (["train.sharding=tp"], "train.sharding='tp'"),
        (["method.lora_dropout=1.5"], "method.lora_dropout=1.5"),
        (["data.eval_fraction=1.0"], "data.eval_fraction=1.0"),
        (["plan.headroom=2"], "plan.headroom=2"),
        (["model.num_kv_heads=3"], "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
        (["train.max_steps=0"], "train.max_steps=0"),
        (["train.sharding=ddp", "train.offload_params=true"], "train.offload_params=true needs"),
        (
            ["model.architecture=phi2"],
            "model.architecture='phi2' is not one of llama, mistral, qwen2, gemma, qwen3, gemma3_text, phi3, mixtral",
        ),
        (["model.num_experts=8"], "model.num_experts_per_token=0 must be in 1..8 (model.num_experts)"),
        (["plan.mfu=0"], "plan.mfu=0"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    text = str(err.value)
    assert message in text
    assert "\n" not in text
