"""The planner's arithmetic and verdicts, checked against exact counts and DESIGN.md's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from finetune.cli import compose, load_profiles
from finetune.config import Config, group_choices
from finetune.errors import PlanError
from finetune.planner import Plan, count_params, lora_params, make_plan
from finetune.planner._activations import layer_bytes_per_token, model_bytes_per_token

PROFILES = load_profiles()
GB = 1e9


def plan_for(*overrides: str) -> tuple[Config, Plan]:
    cfg = compose(["mode=plan", *overrides])
    return cfg, make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)


# ---------------------------------------------------------------- parameter counts


def test_exact_parameter_counts():
    assert count_params(compose(["model=llama3_1_8b"]).model).total == 8_030_261_248
    assert count_params(compose(["model=llama3_1_70b"]).model).total == 70_553_706_496


@pytest.mark.parametrize("name", group_choices("model"))
def test_counts_match_transformers_on_meta_device(name: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    m = compose([f"model={name}"]).model
    kwargs = dict(
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size,
        tie_word_embeddings=m.tie_embeddings,
        max_position_embeddings=m.max_position_embeddings,
    )
    hf_config = Qwen2Config(**kwargs) if m.architecture == "qwen2" else LlamaConfig(**kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in model.parameters())
    assert count_params(m).total == expected


def test_lora_parameter_count_70b_matches_design():
    cfg = compose(["+recipe=llama70b_lora"])
    n = lora_params(cfg.model, cfg.method)
    assert n == 207_093_760  # DESIGN.md: "about 207M parameters (~0.3% of the model)"
    assert 0.0029 < n / count_params(cfg.model).total < 0.0030


def test_lora_count_matches_peft():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = compose(["model=llama3_1_8b", "method=lora", "model.num_layers=2"])
    m = cfg.model
    hf = LlamaConfig(
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    peft_model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=cfg.method.target_modules)
    )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_params(m, cfg.method) == trainable


# ---------------------------------------------------------------- memory terms


def test_qlora_70b_fits_one_h100_at_8k_with_term_breakdown():
    cfg, plan = plan_for("+recipe=llama70b_qlora")
    assert plan.fits and plan.hardware.name == "h100" and plan.seq_len == 8192
    s = plan.strategy
    assert s.activation_checkpointing and s.chunked_loss and s.sharding == "none"
    c = count_params(cfg.model)
    # Weights: NF4 linear layers (0.5 B + constants at 0.127 bits a parameter) + 16-bit embeddings/head/norms.
    expected_weights = c.linear * (4 + 0.127) / 8 + 2 * c.kept_16bit
    assert plan.gpu_memory.weights == pytest.approx(expected_weights / GB, rel=1e-9)
    assert 39.0 < plan.gpu_memory.weights < 40.0
    # fp32 adapters with fp32 grads and Adam moments: 16 bytes a trainable parameter.
    assert plan.gpu_memory.trainable_state == pytest.approx(16 * 207_093_760 / GB, rel=1e-9)
    # Checkpointing keeps hidden x 2 bytes a token per layer (80 x 16 KB = 1.3 MB a token: 10.7 GB at 8k),
    # plus one layer's full activations during recompute.
    kept = 2 * 8192 * 80 * 8192 * s.micro_batch_size
    assert plan.gpu_memory.activations * GB > kept
    assert plan.gpu_memory.total <= plan.usable_gpu_memory_gb < 80


def test_plain_logits_cost_three_times_the_fp32_logits():
    _, plan = plan_for(
        "+recipe=llama70b_qlora", "train.chunked_loss=false", "hardware=b300", "train.micro_batch_size=1"
    )
    fp32_logits = 8192 * 128_256 * 4  # 4.2 GB (DESIGN.md)
    assert fp32_logits / GB == pytest.approx(4.2, abs=0.01)
    assert plan.gpu_memory.logits * GB == pytest.approx(3 * fp32_logits)


# one Llama-3.1-8B decoder layer, as layer_bytes_per_token takes it
LLAMA_8B_LAYER = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)


def _full_8b_layer(checkpointing: bool, autocast: bool) -> int:
    return layer_bytes_per_token(
        **LLAMA_8B_LAYER, method="full", checkpointing=checkpointing, autocast=autocast
    )


@pytest.mark.parametrize("sharding", ["zero3", "none"])
def test_activation_term_uses_measured_coefficients(sharding: str):
    """ZeRO-3 holds DESIGN.md's bf16 working weights; without it the trainer keeps fp32 weights under bf16
    autocast (fp32 residual stream, and autocast's bf16 copy of every weight saved for backward)."""
    hardware = "b300x8" if sharding == "zero3" else "b300"
    cfg, plan = plan_for(
        "model=llama3_1_8b", "method=full", f"hardware={hardware}", "train.seq_len=2048",
        f"train.sharding={sharding}" if sharding != "none" else "train.micro_batch_size=1",
        "train.activation_checkpointing=false", "train.micro_batch_size=1", "train.chunked_loss=true",
    )  # fmt: skip
    assert plan.strategy.sharding == sharding
    m, autocast = cfg.model, sharding == "none"
    # the model never runs its head under a chunked loss: the head's input is not saved there
    once = model_bytes_per_token(
        hidden=4096,
        vocab=128_256,
        plain_loss=False,
        trainable_head=True,
        chunked_loss=True,
        autocast=autocast,
    )
    assert once == model_bytes_per_token(hidden=4096, vocab=128_256, plain_loss=False) - 2 * 4096 + (
        2 * 4096 if autocast else 0
    )
    expected = (_full_8b_layer(False, autocast) * m.num_layers + once) * 2048
    if autocast:
        assert _full_8b_layer(False, True) == _full_8b_layer(False, False) + 10 * 4096
        linear_per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
        expected += 2 * linear_per_layer * m.num_layers  # bf16 weight copies, 14 GB
        expected += 2 * 128_256 * 4096  # and the head's: the model runs it on zero rows, which still casts it
    assert plan.gpu_memory.activations * GB == pytest.approx(expected)


def test_full_finetune_without_deepspeed_is_fp32_weights_under_autocast():
    """16 bytes a parameter either way: 4 + 4 + 8 (fp32 weights, fp32 grads, moments) without sharding,
    2 + (2 + 4 + 8) under ZeRO-3 (bf16 working weights; grads, master, moments in the state)."""
    n = 8_030_261_248
    _, plan = plan_for("model=llama3_1_8b", "method=full", "hardware=b300", "train.seq_len=1024")
    assert plan.strategy.sharding == "none"
    assert plan.gpu_memory.weights * GB == pytest.approx(4 * n)
    assert plan.gpu_memory.trainable_state * GB == pytest.approx(12 * n)
    _, plan = plan_for(
        "model=llama3_1_8b", "method=full", "hardware=b300x8", "train.seq_len=1024", "train.sharding=zero3"
    )
    assert plan.gpu_memory.trainable_state * 8 * GB == pytest.approx(14 * n)  # grads 2 + master 4 + Adam 8


def _lora_8b_layer(checkpointing: bool) -> int:
    """The recipes' LoRA: rank 16, fp32 adapters, dropout on."""
    return layer_bytes_per_token(
        **LLAMA_8B_LAYER,
        method="lora",
        lora_dropout=True,
        adapter_bytes=4,
        lora_rank=16,
        checkpointing=checkpointing,
    )


@pytest.mark.parametrize("chunked", [False, True])
def test_recomputed_layer_is_transient_and_never_coincides_with_the_loss_peak(chunked: bool):
    """With checkpointing the activation term holds each layer's input; the layer being recomputed is in the
    overhead's working set, and only where it exceeds the loss peak (the loss is done before any recompute)."""
    from finetune.planner.core import Calibration

    tokens = 8192
    cfg, plan = plan_for(
        "model=llama3_1_8b", "method=lora", "hardware=h200", f"train.seq_len={tokens}",
        "train.activation_checkpointing=true", "train.micro_batch_size=1", f"train.chunked_loss={str(chunked).lower()}",
    )  # fmt: skip
    mem, cal = plan.gpu_memory, Calibration.default()
    once = model_bytes_per_token(hidden=4096, vocab=128_256, plain_loss=False, trainable_head=False)
    assert mem.activations * GB == pytest.approx((_lora_8b_layer(True) * 32 + once) * tokens)
    four = mem.weights + mem.trainable_state + mem.activations + mem.logits
    working = mem.overhead - cal.cuda_context_gb - cal.allocator_fraction * four
    full_layer = _lora_8b_layer(False) * tokens / GB
    if chunked:  # a chunk's logits are small: the recomputed layer and one layer's backward show
        assert mem.logits < full_layer
        assert working == pytest.approx(
            full_layer + cal.backward_working_set_layers * (full_layer + once * tokens / GB) - mem.logits,
            rel=1e-6,
        )
    else:  # 12.6 GB of logits peak cover the 3.7 GB layer: nothing is added
        assert mem.logits > 3 * full_layer
        assert working == pytest.approx(0.0, abs=1e-9)


def test_8bit_optimizer_saves_six_bytes_a_parameter():
    base = ["model=llama3_1_8b", "method=full", "hardware=b300", "train.seq_len=1024"]
    _, adamw = plan_for(*base, "method.optimizer=adamw")
    _, eight = plan_for(*base, "method.optimizer=adamw_8bit")
    saved = (adamw.gpu_memory.trainable_state - eight.gpu_memory.trainable_state) * GB
    assert saved == pytest.approx(6 * 8_030_261_248)


def test_sharding_divides_state_and_adds_gathered_layers():
    base = ["model=llama3_1_70b", "method=full", "hardware=h200x8", "method.optimizer=adamw"]
    _, plan = plan_for(
        *base, "train.sharding=fsdp", "train.offload_optimizer=false", "train.offload_params=false"
    )
    n = 70_553_706_496
    layer = 855_654_400
    assert plan.gpu_memory.weights * GB == pytest.approx(2 * n / 8 + 2 * 2 * layer)
    assert plan.gpu_memory.trainable_state * GB == pytest.approx(14 * n / 8)


# ---------------------------------------------------------------- verdicts


def test_70b_full_adamw_on_8xh200_needs_optimizer_offload():
    _, plan = plan_for("+recipe=llama70b_full")
    s = plan.strategy
    assert plan.fits
    assert s.sharding == "zero3" and s.offload_optimizer and s.optimizer == "adamw"
    # Offloaded fp32 master + Adam moments: 12 bytes a parameter, in host RAM of the node.
    assert plan.host_memory_gb > 12 * 70_553_706_496 / GB
    assert plan.host_memory_gb < plan.hardware.host_memory_gb


def test_70b_full_without_fixed_optimizer_takes_8bit_before_offload():
    _, plan = plan_for("+recipe=llama70b_full", "method.optimizer=null")
    assert plan.fits and plan.strategy.optimizer == "adamw_8bit" and not plan.strategy.offload_optimizer


def test_70b_lora_does_not_fit_one_h100_and_says_what_would():
    _, plan = plan_for("+recipe=llama70b_lora", "hardware=h100")
    assert not plan.fits
    assert any("largest term is weights" in r for r in plan.reasons)
    assert any(s.startswith("method=qlora fits on h100") for s in plan.suggestions)
    assert any(s.startswith("hardware=") for s in plan.suggestions)
    assert {a.hardware for a in plan.alternatives} == set(PROFILES)


def test_auto_picks_the_cheapest_profile_that_fits():
    _, plan = plan_for("+recipe=llama70b_lora", "hardware=auto")
    assert plan.fits
    fitting = [a for a in plan.alternatives if a.fits]
    assert plan.hardware.usd_per_month == min(a.usd_per_month for a in fitting)
    assert plan.hardware.name == min(fitting, key=lambda a: a.usd_per_month).hardware
    _, small = plan_for("+recipe=llama8b_qlora", "hardware=auto")
    assert small.hardware.name == "h100"


def test_single_gpu_state_on_a_node_runs_ddp():
    _, plan = plan_for("+recipe=llama8b_lora", "hardware=h100x8")
    assert plan.fits and plan.strategy.sharding == "ddp"
    s = plan.strategy
    assert s.micro_batch_size * s.grad_accum_steps * 8 >= 32


@pytest.mark.parametrize(
    "override,check",
    [
        ("train.chunked_loss=false", lambda s: not s.chunked_loss),
        ("train.activation_checkpointing=false", lambda s: not s.activation_checkpointing),
        ("train.micro_batch_size=4", lambda s: s.micro_batch_size == 4),
        ("method.optimizer=adamw", lambda s: s.optimizer == "adamw"),
        ("train.grad_accum_steps=3", lambda s: s.grad_accum_steps == 3),
        ("train.sharding=fsdp", lambda s: s.sharding == "fsdp"),
        ("train.offload_optimizer=false", lambda s: not s.offload_optimizer),
    ],
)
def test_user_fixed_settings_are_honoured(override, check):
    hardware = "hardware=h100x8" if "sharding" in override else "hardware=h100"
    _, plan = plan_for("+recipe=llama70b_qlora", hardware, override)
    assert check(plan.strategy)


def test_fixed_settings_that_cannot_fit_are_refused_not_overridden():
    _, plan = plan_for("+recipe=llama70b_qlora", "train.activation_checkpointing=false")
    assert not plan.fits and not plan.strategy.activation_checkpointing
    assert any("activations" in r for r in plan.reasons)


def test_effective_batch_is_kept_when_micro_batch_shrinks():
    _, plan = plan_for("+recipe=llama70b_qlora")
    s = plan.strategy
    assert s.micro_batch_size * s.grad_accum_steps == 16


def test_seq_len_beyond_model_positions_is_bad_input():
    cfg = compose(["mode=plan", "model=llama3_1_8b", "train.seq_len=200000"])
    with pytest.raises(PlanError, match="exceeds model.max_position_embeddings=131072"):
        make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)


def test_estimate_and_cost():
    cfg, plan = plan_for("+recipe=llama8b_lora", "train.max_steps=100")
    e = plan.estimate
    n = 8_030_261_248
    flops = (4 * n + (2 * n if plan.strategy.activation_checkpointing else 0)) + 6 * 32 * 4096 * 32 * 128
    assert e.tokens_per_second == pytest.approx(0.40 * 989e12 / flops, rel=1e-6)
    tokens = 100 * 32 * 4096
    assert e.run_hours == pytest.approx(tokens / e.tokens_per_second / 3600, rel=1e-6)
    assert e.usd == pytest.approx(e.run_hours * 2190 / 730, rel=1e-6)


def test_disk_sizes():
    _, plan = plan_for("+recipe=llama70b_lora")
    assert plan.disk_export_gb == pytest.approx((2 * 70_553_706_496 + 2 * 207_093_760) / GB)
    # A rank-16 adapter of a 70B model is about 0.4 GB in bf16.
    assert 2 * 207_093_760 / GB == pytest.approx(0.41, abs=0.01)
    _, full = plan_for("model=llama3_1_8b", "method=full", "hardware=b300", "method.optimizer=adamw")
    assert full.disk_checkpoint_gb == pytest.approx(14 * 8_030_261_248 / GB)


def test_plan_contract_fields():
    _, plan = plan_for("+recipe=llama70b_qlora")
    d = json.loads(json.dumps(plan.to_dict()))
    assert set(d) >= {
        "fits", "hardware", "params", "strategy", "gpu_memory_gb", "host_memory_gb",
        "disk_gb", "estimate", "reasons", "suggestions", "alternatives",
    }  # fmt: skip
    assert set(d["hardware"]) == {"name", "gpus", "gpu_memory_gb", "host_memory_gb", "usd_per_month"}
    assert set(d["params"]) == {"total", "trainable"}
    assert set(d["strategy"]) == {
        "sharding", "offload_optimizer", "offload_params", "optimizer", "activation_checkpointing",
        "chunked_loss", "micro_batch_size", "grad_accum_steps",
    }  # fmt: skip
    assert set(d["gpu_memory_gb"]) == {
        "weights",
        "trainable_state",
        "activations",
        "logits",
        "overhead",
        "total",
    }
    assert set(d["disk_gb"]) == {"checkpoint", "export"}
    assert set(d["estimate"]) == {"tokens_per_second", "step_seconds", "run_hours", "usd"}
    assert all(set(a) == {"hardware", "fits", "total_gb", "usd_per_month"} for a in d["alternatives"])
    assert d["strategy"]["sharding"] in ("none", "ddp", "fsdp", "zero3")
    total = sum(v for k, v in d["gpu_memory_gb"].items() if k != "total")
    assert d["gpu_memory_gb"]["total"] == pytest.approx(total, abs=0.01)


def test_planner_is_pure_and_loads_no_torch():
    code = (
        "import sys\n"
        "import finetune.planner as p\n"
        "from finetune.planner import make_plan\n"
        "bad = [m for m in ('torch', 'transformers', 'peft', 'trl', 'hydra') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_is_frozen():
    _, plan = plan_for("+recipe=tiny", "hardware=h100")
    with pytest.raises(AttributeError):
        plan.fits = False  # type: ignore[misc]
    assert replace(plan, fits=False).fits is False
