"""The planner's arithmetic and verdicts, checked against exact counts, the figures of
finetune/planner/MEMORY_MODEL.md and what the trainer runs."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace

import pytest

from finetune.core.composition import compose, group_choices, load_profiles
from finetune.core.config import Config, HardwareConfig, ModelConfig
from finetune.core.errors import PlanError
from finetune.planner import (
    Alternative,
    Calibration,
    Plan,
    Strategy,
    count_params,
    lora_params,
    make_job,
    make_plan,
    memory,
    model_flops_per_token,
    runtime,
)
from finetune.planner import search as search_module
from finetune.planner.activations import (
    LayerRun,
    LayerShape,
    attention_mask_bytes,
    layer_bytes_per_token,
    model_bytes_per_token,
)
from finetune.planner.contract import CONTRACT_HARDWARE
from finetune.planner.job import quant_constant_bits

PROFILES = load_profiles()
GB = 1e9
CAL = Calibration.default()
N_8B, N_70B = 8_030_261_248, 70_553_706_496
LORA_70B = 207_093_760


def plan_for(*overrides: str) -> tuple[Config, Plan]:
    cfg = compose(["mode=plan", *overrides])
    return cfg, make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)


# ---------------------------------------------------------------- parameter counts


def test_exact_parameter_counts():
    assert count_params(compose(["model=llama3_1_8b"]).model).total == N_8B
    assert count_params(compose(["model=llama3_1_70b"]).model).total == N_70B


# text models; a vision-language preset is counted against its own class in tests/test_vlm.py
@pytest.mark.parametrize(
    "name", [n for n in group_choices("model") if not compose([f"model={n}"]).model.takes_images]
)
def test_counts_match_transformers_on_meta_device(name: str):
    """Each model config's count against its family's own transformers class (the tiny builder's config)."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.modeling.tiny import hf_config as family_config

    m = compose([f"model={name}"]).model
    hf_config = family_config(m)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in model.parameters())
    assert count_params(m).total == expected


# Mixtral-8x7B's shape and Gemma-7B's, as their config.json files give them.
MIXTRAL = dict(
    model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    num_hidden_layers=32, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768,
)  # fmt: skip
GEMMA = dict(
    model_type="gemma",
    hidden_size=3072,
    intermediate_size=24576,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=256,
    num_hidden_layers=28,
    vocab_size=256000,
)  # fmt: skip  (no tie_word_embeddings, no max_position_embeddings: GemmaConfig's defaults, tied and 8192)


def _from_json(tmp_path, raw: dict) -> ModelConfig:
    from finetune.modeling.resolve import model_from_config_json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return model_from_config_json(ModelConfig(config_path=str(path)))


def test_mixtral_style_config_is_counted_exactly_and_planned_with_every_expert_resident(tmp_path):
    m = _from_json(tmp_path, MIXTRAL)
    assert (m.architecture, m.num_experts, m.num_experts_per_token, m.tie_embeddings) == (
        "mixtral",
        8,
        2,
        False,
    )
    # by hand: attention 4096 x (4096 + 1024 + 1024) + 4096 x 4096 = 41,943,040; eight experts of
    # 3 x 4096 x 14336 = 1,409,286,144; router 4096 x 8; two norms 8,192; per layer 1,451,270,144, x 32 layers,
    # + embedding and head 2 x 32,000 x 4,096 + the final norm 4,096
    per_layer = 41_943_040 + 1_409_286_144 + 32_768 + 8_192
    assert count_params(m).total == 32 * per_layer + 2 * 32_000 * 4096 + 4096 == 46_702_792_704
    # Mixtral is planned (tests/test_moe_mixtral.py: its recipe): every expert's bf16 weights are resident, so
    # LoRA of the 46.7B model does not fit one H100, and the plan says the weights are why
    cfg = compose(["mode=plan", "hardware=h100"])
    plan = make_plan(m, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)
    assert plan.params_total == 46_702_792_704
    assert plan.gpu_memory.weights == pytest.approx(2 * 46_702_792_704 / 1e9, rel=1e-6)
    assert not plan.fits
    assert "largest term is weights (93.4 GB)" in plan.reasons[0]


def test_mixtral_count_matches_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    small = {
        **MIXTRAL,
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "vocab_size": 1000,
    }
    m = _from_json(tmp_path, small)
    hf = MixtralConfig(**{k: v for k, v in small.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert count_params(m).total == sum(p.numel() for p in model.parameters())


def test_gemma_style_config_takes_the_class_defaults(tmp_path):
    m = _from_json(tmp_path, GEMMA)
    # GemmaConfig's defaults fill what the file leaves out: tied embeddings, 8,192 positions
    assert m.architecture == "gemma" and m.tie_embeddings is True and m.max_position_embeddings == 8192
    # by hand: q, k, v, o 4 x 3072 x 4096 = 50,331,648; MLP 3 x 3072 x 24576 = 226,492,416; norms 6,144;
    # 28 layers; one tied embedding 256,000 x 3,072; the final norm
    per_layer = 50_331_648 + 226_492_416 + 6_144
    c = count_params(m)
    assert c.lm_head == 0 and c.total == 28 * per_layer + 256_000 * 3072 + 3072 == 8_537_680_896
    cfg = compose(["mode=plan", "hardware=h100", "method=lora", "train.seq_len=4096"])
    plan = make_plan(m, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)
    assert plan.params_total == 8_537_680_896 and plan.fits
    # read as untied (the old reader), the plan would hold one more 256,000 x 3,072 bf16 matrix: 1.57 GB
    untied = make_plan(
        replace(m, tie_embeddings=False), cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES
    )
    assert (untied.gpu_memory.weights - plan.gpu_memory.weights) * GB == pytest.approx(2 * 256_000 * 3072)


def test_phi3_fused_projections_are_read_and_partial_rotary_refused(tmp_path):
    from finetune.core.errors import ConfigError

    raw = dict(MIXTRAL, model_type="phi3")
    for key in ("num_local_experts", "num_experts_per_tok"):
        raw.pop(key)
    assert _from_json(tmp_path, raw).architecture == "phi3"  # fused qkv_proj / gate_up_proj: counted
    with pytest.raises(ConfigError, match=r"partial_rotary_factor=0.75 \(rotary embeddings on part"):
        _from_json(tmp_path, dict(raw, partial_rotary_factor=0.75))


def test_target_modules_a_layer_does_not_have_are_refused():
    from finetune.core.errors import ConfigError

    cfg = compose(["mode=plan", "model=llama3_1_8b", "method.target_modules=[qkv_proj,o_proj]"])
    with pytest.raises(
        ConfigError, match="method.target_modules has qkv_proj, which llama layers do not have"
    ):
        make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)


def test_config_json_without_max_position_embeddings_names_the_model_not_tiny(tmp_path):
    raw = dict(GEMMA, model_type="llama", head_dim=128, num_attention_heads=24, num_key_value_heads=8)
    m = _from_json(tmp_path, raw)
    assert m.max_position_embeddings == 2048  # LlamaConfig's default
    cfg = compose(["mode=plan", "hardware=h100", "train.seq_len=4096"])
    # named by its config (architecture and size), not by tiny, the default it replaced
    with pytest.raises(PlanError, match=r"max_position_embeddings=2048 of llama-8\.6B$"):
        make_plan(m, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)


def test_lora_parameter_count_70b_matches_design():
    cfg = compose(["+recipe=llama70b_lora"])
    n = lora_params(cfg.model, cfg.method)
    assert n == LORA_70B  # MEMORY_MODEL.md, Parameters: 207,093,760 (0.29%)
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
        model, LoraConfig(r=16, lora_alpha=32, target_modules=cfg.method.targets(m.architecture))
    )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_params(m, cfg.method) == trainable


# ---------------------------------------------------------------- what runs: dtypes per engine


def _terms(*overrides: str, **strategy) -> tuple[Config, Strategy, object]:
    cfg = compose(["mode=plan", *overrides])
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.train.seq_len)
    s = Strategy(**strategy)
    return cfg, s, job


@pytest.mark.parametrize(
    "method,sharding,hardware,per_param",
    [
        (
            "qlora",
            "none",
            "h100",
            2 + 2 + 4,
        ),  # bf16 adapters (qlora.yaml): torch AdamW keeps bf16 moments, no master
        ("lora", "none", "h100", 4 + 4 + 8),  # fp32 adapters
        (
            "lora",
            "fsdp",
            "h100x8",
            (4 + 4 + 8) / 8,
        ),  # accelerate upcasts trainable parameters to fp32, sharded
        (
            "lora",
            "zero3",
            "h100x8",
            (2 + 2 + 4 + 8) / 8,
        ),  # DeepSpeed's bf16: bf16 adapters, fp32 master and moments
    ],
)
def test_trainable_state_bytes_follow_the_engine(method, sharding, hardware, per_param):
    cfg, s, job = _terms(f"method={method}", "model=llama3_1_8b", f"hardware={hardware}", sharding=sharding)
    mem, _ = memory(job, s)
    adapters = lora_params(cfg.model, cfg.method)
    extra = 0.0
    if sharding == "zero3":  # one fp32 gradient buffer for an optimizer sub-group, and a reduce bucket
        extra = 4 * adapters / 8 + 2 * 4096**2
    assert mem.trainable_state * GB == pytest.approx(per_param * adapters + extra)


def test_runtime_per_engine():
    _, s, job = _terms("model=llama3_1_8b", "method=lora", "hardware=h100x8", sharding="none")
    rt = runtime(job, s)
    assert rt.autocast and rt.adapter_storage == 4 and rt.compute == 2  # accelerate's autocast, PEFT's fp32
    fsdp = runtime(job, replace(s, sharding="fsdp"))
    assert fsdp.autocast and fsdp.adapter_storage == 4 and fsdp.adapter_compute == 2
    zero3 = runtime(job, replace(s, sharding="zero3"))
    assert not zero3.autocast and zero3.adapter_storage == zero3.adapter_compute == 2
    _, s, full = _terms("model=llama3_1_8b", "method=full", "hardware=h100x8", sharding="none")
    assert runtime(full, s).fp32_residual and not runtime(full, replace(s, sharding="fsdp")).fp32_residual


def test_qlora_70b_fits_one_h100_at_8k_with_term_breakdown():
    cfg, plan = plan_for("+recipe=llama70b_qlora")
    assert plan.fits and plan.hardware.name == "h100" and plan.seq_len == 8192
    s = plan.strategy
    assert s.activation_checkpointing and s.chunked_loss and s.sharding == "none"
    c = count_params(cfg.model)
    # Weights: NF4 linear layers (0.5 B + constants at 0.127 bits a parameter) + 16-bit embeddings/head/norms.
    assert quant_constant_bits(True) == pytest.approx(0.127, abs=1e-3)
    expected_weights = c.linear * (4 + quant_constant_bits(True)) / 8 + 2 * c.kept_16bit
    assert plan.gpu_memory.weights == pytest.approx(expected_weights / GB, rel=1e-9)
    assert 39.0 < plan.gpu_memory.weights < 40.0
    # bf16 adapters: weights, gradients and torch AdamW's bf16 moments, 8 bytes a trainable parameter.
    assert plan.gpu_memory.trainable_state == pytest.approx(8 * LORA_70B / GB, rel=1e-9)
    # Checkpointing keeps hidden x 2 bytes a token per layer (80 x 16 KB = 1.3 MB a token: 10.7 GB at 8k), the
    # packed rows' boolean mask and the final norm's upcast.
    once = model_bytes_per_token(hidden=8192, vocab=128_256, plain_loss=False, trainable_head=False)
    expected = (2 * 8192 * 80 + once) * 8192 + 8192**2
    assert plan.gpu_memory.activations * GB == pytest.approx(expected)
    assert plan.gpu_memory.total <= plan.usable_gpu_memory_gb < 80


def test_double_quant_off_costs_its_constants():
    _, on = plan_for("+recipe=llama70b_qlora")
    _, off = plan_for("+recipe=llama70b_qlora", "method.double_quant=false")
    linear = count_params(compose(["model=llama3_1_70b"]).model).linear
    assert quant_constant_bits(False) == 0.5  # an fp32 absmax per 64 weights
    assert (off.gpu_memory.weights - on.gpu_memory.weights) * GB == pytest.approx(
        linear * (0.5 - 0.126953125) / 8
    )
    assert off.gpu_memory.weights - on.gpu_memory.weights > 3.1  # the 70B's 3.2 GB of constants


def test_fp32_precision_doubles_the_16_bit_activations():
    _, bf16 = plan_for("model=llama3_1_8b", "method=full", "hardware=b300", "train.seq_len=1024",
                       "train.activation_checkpointing=false", "train.micro_batch_size=1", "method.precision=bf16")  # fmt: skip
    _, fp32 = plan_for("model=llama3_1_8b", "method=full", "hardware=b300", "train.seq_len=1024",
                       "train.activation_checkpointing=false", "train.micro_batch_size=1", "method.precision=fp32")  # fmt: skip
    shape = LayerShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
    per_token = layer_bytes_per_token(
        shape, LayerRun(method="full", packed=True, dtype_bytes=4, device="cuda")
    )
    assert per_token == 24 * 4096 + 16 * 14336 + 8 * 4096 + 8 * 1024 + 4 * 32 + 8 + 8 * (4096 - 1024)
    once = model_bytes_per_token(
        hidden=4096, vocab=128_256, plain_loss=False, head_in_model=False, dtype_bytes=4
    )
    expected = (per_token * 32 + once) * 1024 + 32 * attention_mask_bytes(tokens=1024, rows=1, dtype_bytes=4)
    assert fp32.gpu_memory.activations * GB == pytest.approx(expected)
    # bf16 (the trainer's fp32 weights under autocast) keeps bf16 copies of every weight instead
    assert fp32.gpu_memory.activations != pytest.approx(bf16.gpu_memory.activations, rel=0.05)


def test_full_fine_tuning_activations_as_the_trainer_runs_them():
    """One GPU: fp32 weights under autocast (fp32 residual, bf16 weight copies saved); no copy of the head: the
    loss runs it, the model does not."""
    cfg, plan = plan_for(
        "model=llama3_1_8b", "method=full", "hardware=b300", "train.seq_len=2048",
        "train.activation_checkpointing=false", "train.micro_batch_size=1",
    )  # fmt: skip
    shape = LayerShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
    per_token = layer_bytes_per_token(
        shape, LayerRun(method="full", autocast=True, device="cuda", packed=True)
    )
    once = model_bytes_per_token(
        hidden=4096, vocab=128_256, plain_loss=False, head_in_model=False, autocast=True
    )
    linear_per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
    expected = (per_token * 32 + once) * 2048
    expected += 32 * (
        2 * linear_per_layer + attention_mask_bytes(tokens=2048, rows=1)
    )  # weight copies, mask biases
    assert plan.gpu_memory.activations * GB == pytest.approx(expected)


def test_full_fine_tune_state_per_engine():
    """16 bytes a parameter either way: 4 + 4 + 8 (fp32 weights, fp32 grads, moments) on one GPU,
    2 + (2 + 4 + 8) under ZeRO-3 (bf16 working weights; grads, master, moments in the state)."""
    _, plan = plan_for("model=llama3_1_8b", "method=full", "hardware=b300", "train.seq_len=1024")
    assert plan.strategy.sharding == "none"
    assert plan.gpu_memory.weights * GB == pytest.approx(4 * N_8B)
    assert plan.gpu_memory.trainable_state * GB == pytest.approx(12 * N_8B)
    _, plan = plan_for(
        "model=llama3_1_8b", "method=full", "hardware=b300x8", "train.seq_len=1024", "train.sharding=zero3",
        "method.optimizer=adamw",
    )  # fmt: skip
    buffers = 4 * min(1e9, N_8B / 8) + 2 * 4096**2  # one sub-group's fp32 gradients (at most 1e9), a bucket
    assert plan.gpu_memory.trainable_state * GB == pytest.approx(14 * N_8B / 8 + buffers)


def test_8bit_optimizer_saves_six_bytes_a_parameter():
    base = ["model=llama3_1_8b", "method=full", "hardware=b300", "train.seq_len=1024"]
    _, adamw = plan_for(*base, "method.optimizer=adamw")
    _, eight = plan_for(*base, "method.optimizer=adamw_8bit")
    saved = (adamw.gpu_memory.trainable_state - eight.gpu_memory.trainable_state) * GB
    assert saved == pytest.approx(6 * N_8B)


def test_fsdp_shards_fp32_state_and_holds_gathered_layers_and_the_tail():
    base = ["model=llama3_1_70b", "method=full", "hardware=h200x8", "method.optimizer=adamw"]
    _, plan = plan_for(
        *base, "train.sharding=fsdp", "train.offload_optimizer=false", "train.offload_params=false"
    )
    layer = 855_654_400  # one decoder layer's weights and norms
    head = 128_256 * 8192 + 8192  # the tail unit: LM head and final norm, gathered in bf16 across the loss
    assert plan.gpu_memory.weights * GB == pytest.approx(4 * N_70B / 8 + 2 * 2 * layer + 2 * head)
    assert plan.gpu_memory.trainable_state * GB == pytest.approx(12 * N_70B / 8)


# ---------------------------------------------------------------- the loss


@pytest.mark.parametrize("chunked", [True, False])
def test_loss_term_models_the_path_the_trainer_takes(chunked: bool):
    """LoRA (frozen bf16 head), 8,192 tokens: ours a 1.5x fp32 [1024, V] chunk, the bf16 hidden-state gradient and a
    chunk's rows; TRL's the saved bf16 hidden states, and in its backward fp32 [N, h] gradients, a bf16 [4096, 32768]
    tile and the bf16 cast of the gradient. Neither is near the 12.6 GB the plain loss's factor charged."""
    _, plan = plan_for(
        "model=llama3_1_8b", "method=lora", "hardware=h200", "train.seq_len=8192", "train.micro_batch_size=1",
        f"train.chunked_loss={str(chunked).lower()}", "train.activation_checkpointing=true",
    )  # fmt: skip
    n, h, v = 8192, 4096, 128_256
    if chunked:
        expected = 1.5 * 4 * 1024 * v + 2 * n * h + 2 * 2 * 1024 * h
    else:
        expected = 2 * n * h + 24 * n + 4 * n * h + 2 * 4096 * 32768
    assert plan.gpu_memory.logits * GB == pytest.approx(expected)
    assert plan.gpu_memory.logits < 1.0


def test_default_loss_is_one_constant(monkeypatch):
    _, plan = plan_for("+recipe=llama8b_lora")
    assert plan.strategy.chunked_loss is search_module.DEFAULT_CHUNKED_LOSS
    monkeypatch.setattr(search_module, "DEFAULT_CHUNKED_LOSS", not search_module.DEFAULT_CHUNKED_LOSS)
    _, flipped = plan_for("+recipe=llama8b_lora")
    assert flipped.strategy.chunked_loss is search_module.DEFAULT_CHUNKED_LOSS
    assert any("(the default)" in r for r in flipped.reasons)


def test_recomputed_layer_is_transient_and_counted_above_the_loss_peak():
    tokens = 8192
    _, plan = plan_for(
        "model=llama3_1_8b", "method=lora", "hardware=h200", f"train.seq_len={tokens}",
        "train.activation_checkpointing=true", "train.micro_batch_size=1",
    )  # fmt: skip
    mem = plan.gpu_memory
    shape = LayerShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
    run = LayerRun(
        method="lora", adapter_bytes=4, autocast=True, lora_dropout=True, device="cuda", packed=True
    )
    full_layer = layer_bytes_per_token(shape, run) * tokens + attention_mask_bytes(tokens=tokens, rows=1)
    once = model_bytes_per_token(hidden=4096, vocab=128_256, plain_loss=False, trainable_head=False) * tokens
    cfg = compose(["model=llama3_1_8b", "method=lora"])
    adapter_copies = (
        2 * lora_params(cfg.model, cfg.method) // 32
    )  # autocast's bf16 copies of one layer's adapters
    working = full_layer + adapter_copies + CAL.cuda.backward_working_set_layers * (full_layer + once)
    above = working / GB - mem.logits
    # the allocator's share: of what a step allocates and frees, the fp32 adapters' gradients included
    fluctuating = mem.activations + mem.logits + above + 4 * lora_params(cfg.model, cfg.method) / GB
    expected = CAL.cuda.fixed_gb + above + CAL.cuda.allocator_fraction * fluctuating
    # the packed rows' mask biases of the layer in backward and the recomputed one are the attention term
    mask = attention_mask_bytes(tokens=tokens, rows=1) * (1 + CAL.cuda.backward_working_set_layers)
    assert mem.attention * GB == pytest.approx(mask, rel=1e-9)
    assert mem.overhead + mem.attention == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- the fastest strategy that fits


def test_fastest_plan_skips_recomputation_when_memory_allows():
    """llama8b_lora at 4,096 tokens fits one H100 without checkpointing at micro-batch 1: that is faster than any
    checkpointed micro-batch (recomputation costs a forward), so it wins."""
    _, plan = plan_for("+recipe=llama8b_lora")
    s = plan.strategy
    assert (
        plan.fits and not s.activation_checkpointing and s.micro_batch_size == 1 and s.grad_accum_steps == 32
    )
    _, ckpt = plan_for("+recipe=llama8b_lora", "train.activation_checkpointing=true")
    assert ckpt.estimate.tokens_per_second < plan.estimate.tokens_per_second
    assert ckpt.strategy.micro_batch_size > 1  # the largest micro-batch that fits, for the same time a token


def test_checkpointing_is_taken_when_nothing_else_fits():
    _, plan = plan_for("+recipe=llama8b_lora", "train.seq_len=16384")
    assert plan.fits and plan.strategy.activation_checkpointing
    assert any(r.startswith("activation checkpointing: ") for r in plan.reasons)


def test_70b_full_adamw_on_8xh200_needs_optimizer_offload():
    _, plan = plan_for("+recipe=llama70b_full")
    s = plan.strategy
    assert plan.fits
    assert s.sharding == "zero3" and s.offload_optimizer and s.optimizer == "adamw"
    # Offloaded: fp32 master, moments, fp32 sub-group gradients and bf16 gradient partitions, 18 bytes a parameter.
    assert plan.host_memory_gb == pytest.approx(18 * N_70B / GB + 8 * CAL.host_gb_per_rank)
    assert plan.host_memory_gb < plan.hardware.host_memory_gb


def test_70b_full_without_fixed_optimizer_takes_8bit_rather_than_offload():
    """8-bit states fit without offload, and offload costs CPU time every step: the 8-bit plan is faster."""
    _, plan = plan_for("+recipe=llama70b_full", "method.optimizer=null")
    assert plan.fits and plan.strategy.optimizer == "adamw_8bit" and not plan.strategy.offload_optimizer


def test_70b_lora_does_not_fit_one_h100_and_says_what_would():
    _, plan = plan_for("+recipe=llama70b_lora", "hardware=h100")
    assert not plan.fits
    assert any("largest term is weights" in r for r in plan.reasons)
    assert any(s.startswith("method=qlora fits on h100") for s in plan.suggestions)
    assert any(s.startswith("hardware=") for s in plan.suggestions)
    assert {a.hardware for a in plan.alternatives} == {
        name for name, p in PROFILES.items() if p.device == "cuda" and p.gpu_memory_gb is not None
    }


def test_single_gpu_state_on_a_node_runs_ddp():
    _, plan = plan_for("+recipe=llama8b_lora", "hardware=h100x8")
    assert plan.fits and plan.strategy.sharding == "ddp"
    s = plan.strategy
    assert s.micro_batch_size * s.grad_accum_steps * 8 >= 32


@pytest.mark.parametrize(
    "override,check",
    [
        ("train.chunked_loss=false", lambda s: not s.chunked_loss),
        ("train.activation_checkpointing=true", lambda s: s.activation_checkpointing),
        ("train.micro_batch_size=4", lambda s: s.micro_batch_size == 4),
        ("method.optimizer=adamw", lambda s: s.optimizer == "adamw"),
        ("train.grad_accum_steps=3", lambda s: s.grad_accum_steps == 3),
        ("train.offload_optimizer=false", lambda s: not s.offload_optimizer),
    ],
)
def test_user_fixed_settings_are_honoured(override, check):
    _, plan = plan_for("+recipe=llama70b_qlora", override)
    assert check(plan.strategy)


@pytest.mark.parametrize("sharding", ["fsdp", "zero3", "ddp"])
def test_user_fixed_sharding_is_honoured(sharding):
    _, plan = plan_for("+recipe=llama70b_lora", f"train.sharding={sharding}")
    assert plan.strategy.sharding == sharding


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


# ---------------------------------------------------------------- every plan executable


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            [
                "+recipe=llama70b_full",
                "train.engine=fsdp",
                "train.sharding=fsdp",
                "method.optimizer=adamw_8bit",
            ],
            "method.optimizer=adamw_8bit does not run under train.sharding=fsdp (bitsandbytes' 8-bit optimizers have "
            "no DTensor support): use train.engine=zero3",
        ),
        (
            ["+recipe=llama8b_lora", "train.offload_optimizer=true"],
            "train.offload_optimizer=true needs train.sharding=fsdp or zero3: one process holds everything",
        ),
        (
            [
                "+recipe=llama70b_full",
                "train.sharding=zero3",
                "train.offload_optimizer=true",
                "method.optimizer=adamw_8bit",
            ],
            "method.optimizer=adamw_8bit with optimizer offload: ZeRO-3 offloads only its own fp32 CPU Adam",
        ),  # fmt: skip
        (
            [
                "+recipe=llama70b_full",
                "train.engine=fsdp",
                "train.sharding=fsdp",
                "train.offload_optimizer=true",
                "train.offload_params=false",
            ],
            "FSDP2 offloads parameters, gradients and optimizer state together",
        ),  # fmt: skip
    ],
)
def test_fixed_settings_no_engine_runs_are_refused_with_one_line(overrides, needle):
    cfg = compose(["mode=plan", *overrides])
    with pytest.raises(PlanError) as info:
        make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_fsdp_never_gets_8bit_states_and_offloads_everything_together():
    _, plan = plan_for("+recipe=qwen32b_full", "train.engine=fsdp")
    s = plan.strategy
    assert s.sharding == "fsdp" and s.optimizer == "adamw"
    assert s.offload_optimizer == s.offload_params
    _, ds = plan_for("+recipe=qwen32b_full", "train.engine=zero3")
    assert (
        ds.strategy.sharding == "zero3" and ds.strategy.optimizer == "adamw_8bit"
    )  # ZeRO-3 runs 8-bit states


def test_every_candidate_is_one_the_engine_runs():
    from finetune.planner import candidates, why_not

    for recipe in ("llama70b_full", "llama70b_lora", "qwen32b_full", "llama70b_qlora"):
        for hardware in ("h100", "h100x8", "b300x8"):
            cfg = compose(["mode=plan", f"+recipe={recipe}", f"hardware={hardware}", "method.optimizer=null"])
            job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.train.seq_len)
            found, _ = candidates(job)
            assert found
            for s in found:
                assert why_not(s, cfg.method.name, cfg.hardware.total_gpus) is None


# ---------------------------------------------------------------- hardware=auto


def test_auto_picks_the_cheapest_profile_that_fits():
    _, plan = plan_for("+recipe=llama70b_lora", "hardware=auto")
    assert plan.fits
    fitting = [a for a in plan.alternatives if a.fits]
    assert plan.hardware.usd_per_month == min(a.usd_per_month for a in fitting)
    assert plan.reasons[0].startswith(
        f"hardware=auto: {plan.hardware.name} is the cheapest profile that fits"
    )
    _, small = plan_for("+recipe=llama8b_qlora", "hardware=auto")
    assert small.hardware.name == "h100"


def test_auto_with_a_run_length_picks_the_cheapest_run_and_says_so():
    _, plan = plan_for("+recipe=llama70b_lora", "hardware=auto", "train.max_steps=1000")
    assert plan.fits and plan.estimate.usd is not None
    assert plan.reasons[0].startswith(f"hardware=auto: {plan.hardware.name} costs the least for this run: ")
    for name in [a.hardware for a in plan.alternatives if a.fits]:
        cfg = compose(["mode=plan", "+recipe=llama70b_lora", f"hardware={name}", "train.max_steps=1000"])
        other = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)
        assert other.estimate.usd >= plan.estimate.usd - 1e-6
    cheapest_per_month = min((a for a in plan.alternatives if a.fits), key=lambda a: a.usd_per_month)
    assert cheapest_per_month.hardware != plan.hardware.name  # the run's cost, not the month's, decided


def test_auto_keeps_a_fixed_sharding_and_the_node_count():
    _, plan = plan_for("+recipe=llama70b_lora", "hardware=auto", "train.sharding=fsdp")
    assert plan.strategy.sharding == "fsdp" and plan.hardware.total_gpus > 1
    assert any(
        r.startswith("hardware=auto: skipped b200, b300, h100, h200 (train.sharding=fsdp")
        for r in plan.reasons
    )
    _, two = plan_for("+recipe=llama70b_lora", "hardware=auto", "hardware.nodes=2")
    assert two.hardware.nodes == 2
    assert two.reasons[0].endswith(
        f"({2 * two.hardware.usd_per_month:,.0f} USD/month; give train.max_steps or train.dataset_tokens to compare "
        "the cost of the run)"
    )


def test_unknown_host_ram_is_said_not_skipped():
    _, plan = plan_for("+recipe=llama70b_full", "hardware=b300x8", "hardware.host_memory_gb=null",
                       "train.offload_optimizer=true")  # fmt: skip
    assert plan.strategy.offload_optimizer
    assert any(r.startswith("host RAM of b300x8 is not published: the ") for r in plan.reasons)


# ---------------------------------------------------------------- time, cost, disk


def test_estimate_and_cost():
    cfg, plan = plan_for("+recipe=llama8b_lora", "train.max_steps=100")
    e, s = plan.estimate, plan.strategy
    m = cfg.model
    c = count_params(m)
    flops = 4 * (c.linear + c.head) + 6 * 32 * 4096 * 32 * 128  # the input embedding is a lookup
    assert model_flops_per_token(m, "lora", 4096) == flops
    if s.activation_checkpointing:
        flops += 2 * c.linear + 2 * 32 * 4096 * 32 * 128
    util = CAL.cuda.utilisation["lora"]
    assert e.tokens_per_second == pytest.approx(util * 989e12 / flops, rel=1e-6)
    tokens = 100 * 32 * 4096
    assert e.run_hours == pytest.approx(tokens / e.tokens_per_second / 3600, rel=1e-6)
    assert e.usd == pytest.approx(e.run_hours * 2190 / 730, rel=1e-6)
    _, fixed = plan_for("+recipe=llama8b_lora", "train.max_steps=100", "plan.mfu=0.40")
    assert fixed.estimate.tokens_per_second == pytest.approx(0.40 / util * e.tokens_per_second, rel=1e-6)


def test_trl_loss_is_slower_by_its_fitted_extra():
    _, ours = plan_for(
        "+recipe=llama8b_lora", "train.activation_checkpointing=true", "train.chunked_loss=true"
    )
    _, trl = plan_for(
        "+recipe=llama8b_lora", "train.activation_checkpointing=true", "train.chunked_loss=false"
    )
    extra = CAL.cuda.trl_loss_extra_hv_flops * 4096 * 128_256
    assert 1 / trl.estimate.tokens_per_second - 1 / ours.estimate.tokens_per_second == pytest.approx(
        extra / (CAL.cuda.utilisation["lora"] * 989e12), rel=1e-6
    )


def test_disk_sizes():
    _, plan = plan_for("+recipe=llama70b_lora")
    assert plan.disk_export_gb == pytest.approx((2 * N_70B + 2 * LORA_70B) / GB)
    # A rank-16 adapter of a 70B model is about 0.4 GB in bf16.
    assert 2 * LORA_70B / GB == pytest.approx(0.41, abs=0.01)
    _, full = plan_for("model=llama3_1_8b", "method=full", "hardware=b300", "method.optimizer=adamw")
    assert full.disk_checkpoint_gb == pytest.approx(12 * N_8B / GB)  # fp32 weights and moments


# ---------------------------------------------------------------- the contract


def test_plan_contract_fields():
    _, plan = plan_for("+recipe=llama70b_qlora")
    d = json.loads(json.dumps(plan.to_dict()))
    assert set(d) >= {
        "fits", "hardware", "params", "strategy", "gpu_memory_gb", "host_memory_gb",
        "disk_gb", "estimate", "reasons", "suggestions", "alternatives",
    }  # fmt: skip
    assert list(d["hardware"])[:5] == ["name", "gpus", "gpu_memory_gb", "host_memory_gb", "usd_per_month"]
    # then the whole profile and the process layout (added after the contract's fields, none renamed)
    assert set(d["hardware"]) == set(CONTRACT_HARDWARE) | {f.name for f in fields(HardwareConfig)}
    assert d["layout"] == {"nodes": 1, "processes_per_node": 1, "world_size": 1, "engine": "single"}
    assert list(d)[-1] == "layout"
    assert set(d["params"]) == {"total", "trainable", "active"}
    assert set(d["strategy"]) == {
        "sharding", "offload_optimizer", "offload_params", "optimizer", "activation_checkpointing",
        "chunked_loss", "micro_batch_size", "grad_accum_steps",
        "precompute_reference", "sequence_parallel", "sequence_split", "activation_offloading", "attention",
    }  # fmt: skip
    assert set(d["gpu_memory_gb"]) == {
        "weights",
        "trainable_state",
        "activations",
        "logits",
        "attention",
        "overhead",
        "vision_activations",
        "total",
    }
    assert set(d["disk_gb"]) == {"checkpoint", "export"}
    assert set(d["estimate"]) == {"tokens_per_second", "step_seconds", "run_hours", "usd"}
    assert all(
        list(a)[:4]
        == ["hardware", "fits", "total_gb", "usd_per_month"]  # then the added fields, none renamed
        and set(a) == {f.name for f in fields(Alternative)}
        for a in d["alternatives"]
    )
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


def test_cpu_plans_use_the_cpu_calibration():
    """On the CPU the fixed share is the process's, and no utilisation is fitted: no time estimate."""
    cfg = compose(["mode=plan", "+recipe=tiny", "hardware.gpu_memory_gb=16", "hardware.peak_bf16_tflops=1"])
    plan = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)
    assert plan.hardware.device == "cpu" and plan.fits
    fluctuating = plan.gpu_memory.activations + plan.gpu_memory.logits  # at least
    assert plan.gpu_memory.overhead >= CAL.cpu.fixed_gb + CAL.cpu.allocator_fraction * fluctuating
    assert plan.estimate.tokens_per_second is None
    assert "no time estimate: profile cpu has no fitted utilisation for cpu" in plan.reasons
    assert HardwareConfig().device == "cpu"


def test_host_ram_counts_loading_the_model_per_engine():
    """Loading, before any optimizer state: every rank holds the whole model (one process, DDP); FSDP2's
    first rank of a node (cpu_ram_efficient_loading); ZeRO-3 a checkpoint shard per rank (zero.Init)."""
    from finetune.planner.job import make_job
    from finetune.planner.weights import CHECKPOINT_SHARD_BYTES, load_host_bytes

    _, lora = plan_for("+recipe=llama8b_lora")  # one H100: the bf16 base in host RAM, and the process
    assert lora.strategy.sharding == "none"
    assert lora.host_memory_gb == pytest.approx(2 * lora.params_total / 1e9 + 4.0, abs=1e-3)

    cfg, full = plan_for("+recipe=llama70b_full")  # ZeRO-3 with optimizer offload on 8 x H200
    job = make_job(cfg.model, cfg.method, full.hardware, cfg.train, full.seq_len)
    s = full.strategy
    assert load_host_bytes(job, s) == 8 * CHECKPOINT_SHARD_BYTES  # zero.Init: not 8 fp32 copies (2.26 TB)
    assert load_host_bytes(job, replace(s, sharding="ddp")) == 8 * 4 * full.params_total
    assert load_host_bytes(job, replace(s, sharding="fsdp")) == 4 * full.params_total
    # offload's state is the larger need: 18 bytes a parameter over the node, and the processes
    assert full.host_memory_gb == pytest.approx(18 * full.params_total / 1e9 + 8 * 4.0, rel=1e-3)

    _, refused = plan_for("+recipe=llama70b_full", "train.sharding=ddp", "method.optimizer=adamw_8bit")
    assert not refused.fits and any(r.startswith("host memory: 2,290 GB per node") for r in refused.reasons)


def test_plan_json_round_trips_the_whole_profile_and_refuses_an_older_one():
    cfg, plan = plan_for("+recipe=llama70b_full", "hardware=auto")
    d = json.loads(json.dumps(plan.to_dict()))
    back = Plan.from_dict(d)
    assert back.hardware == plan.hardware and back.hardware.name != "auto" and back.layout == plan.layout
    assert {k: back.to_dict()[k] for k in ("hardware", "layout", "strategy")} == {
        k: d[k] for k in ("hardware", "layout", "strategy")
    }
    old = {**d, "hardware": {k: d["hardware"][k] for k in CONTRACT_HARDWARE}}
    del old["layout"]
    with pytest.raises(PlanError, match=r"^plan.json was written by an older finetune \(no hardware.device\): "
                       r"re-run mode=plan with this run_dir$"):  # fmt: skip
        Plan.from_dict(old)
