"""Sharded QLoRA planned byte by byte, the engine sought across FSDP2 and ZeRO-3,
the allocator's share of what a step allocates and frees, and the suggestions that shard a job across GPUs."""

from __future__ import annotations

import sys

import pytest

from finetune.core.composition import compose, load_profiles
from finetune.core.config import Config
from finetune.planner import Calibration, Plan, Strategy, make_job, make_plan, runtime

PROFILES = load_profiles()
CAL = Calibration.default()
GB = 1e9
MEMORY = sys.modules["finetune.planner.memory"]  # the module (the package exports its `memory` function)
# Llama-3.1-70B (MEMORY_MODEL.md, section 1): linear weights (QLoRA's 4-bit part), kept in 16 bits, per layer
LINEAR_70B, KEPT_70B, LAYERS_70B = 68_451_041_280, 2_102_665_216, 80
HEAD_70B = 128_256 * 8192
NF4_BITS = 8 / 64 + 32 / (64 * 256)  # double-quantized constants a weight


def plan_for(*overrides: str) -> tuple[Config, Plan]:
    cfg = compose(["mode=plan", *overrides])
    return cfg, make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)


def _job(cfg: Config, plan: Plan):
    return make_job(cfg.model, cfg.method, plan.hardware, cfg.train, plan.seq_len, None, cfg.plan)


# ---------------------------------------------------------------- sharded QLoRA, term by term


@pytest.mark.parametrize("sharding", ["fsdp", "zero3"])
def test_sharded_qlora_divides_the_4bit_weights_as_stored_and_keeps_the_constants_whole(sharding):
    cfg, plan = plan_for(
        "model=llama3_1_70b", "method=qlora", "hardware=l40s", "hardware.gpus_per_node=2",
        f"train.sharding={sharding}", "train.seq_len=2048", "train.activation_checkpointing=true",
        "train.offload_optimizer=false", "train.offload_params=false",
    )  # fmt: skip
    assert plan.strategy.sharding == sharding and plan.layout.world_size == 2
    # the 4-bit weights (half a byte each, stored in bf16) and the 16-bit rest are parameters: halved
    divided = LINEAR_70B / 2 + 2 * KEPT_70B
    # bitsandbytes keeps the NF4 constants in each weight's quant_state: whole on every rank
    constants = LINEAR_70B * NF4_BITS / 8
    # two decoder layers gathered as stored (the 4-bit packing and two bf16 norms)
    gathered = 2 * (LINEAR_70B / LAYERS_70B / 2 + 2 * 2 * 8192)
    tail = 2 * (HEAD_70B + 8192) if sharding == "fsdp" else 0  # FSDP2 holds the final norm and head gathered
    expected = divided / 2 + constants + gathered + tail
    assert plan.gpu_memory.weights * GB == pytest.approx(expected, rel=1e-9)
    assert constants / GB == pytest.approx(1.086, abs=1e-3)


def test_sharded_qlora_adapters_keep_their_dtype_under_fsdp2():
    """accelerate's FSDP2 upcasts trainable parameters to fp32 except in a model with bitsandbytes' 4-bit
    weights: QLoRA's bf16 adapters keep 2 + 2 + 4 bytes (torch AdamW's bf16 moments), divided by the GPUs."""
    cfg, plan = plan_for(
        "model=llama3_1_70b", "method=qlora", "hardware=l40s", "hardware.gpus_per_node=2",
        "train.sharding=fsdp", "train.seq_len=2048", "method.optimizer=adamw",
        "train.offload_optimizer=false", "train.offload_params=false",
    )  # fmt: skip
    adapters = 207_093_760  # LoRA r16 on the seven projections (MEMORY_MODEL.md, section 1)
    assert plan.gpu_memory.trainable_state * GB == pytest.approx(8 * adapters / 2)
    _, lora = plan_for(
        "model=llama3_1_70b", "method=lora", "hardware=h100x8", "train.sharding=fsdp", "train.seq_len=2048",
        "method.optimizer=adamw", "train.offload_optimizer=false", "train.offload_params=false",
    )  # fmt: skip
    assert lora.gpu_memory.trainable_state * GB == pytest.approx(16 * adapters / 8)  # LoRA: upcast to fp32


def test_sharded_qlora_loads_the_whole_4bit_model_on_every_rank_in_host_ram():
    """No zero.Init for a quantized model and no cpu_ram_efficient_loading for 4-bit weights: each rank
    quantizes the whole model on the CPU, a 5 GB checkpoint shard at a time, then the engine divides it."""
    cfg, plan = plan_for("model=llama3_1_70b", "method=qlora", "hardware=a10gx4", "train.seq_len=2048")
    assert plan.fits and plan.strategy.engine.shards
    whole_4bit = LINEAR_70B * (4 + NF4_BITS) / 8 + 2 * KEPT_70B
    assert plan.host_memory_gb == pytest.approx(4 * (whole_4bit + 5e9) / GB + 4 * CAL.host_gb_per_rank)
    assert plan.host_memory_gb < plan.hardware.host_memory_gb  # g5.12xlarge's 206 GB
    _, one = plan_for("+recipe=llama70b_qlora")  # one GPU: quantized straight onto it through a device map
    assert one.host_memory_gb == pytest.approx(5 + CAL.host_gb_per_rank)


def test_70b_qlora_on_two_48gb_gpus_fits_at_8k():
    _, plan = plan_for("model=llama3_1_70b", "method=qlora", "hardware=l40s", "hardware.gpus_per_node=2",
                       "train.seq_len=8192")  # fmt: skip
    assert plan.fits and plan.strategy.engine.shards and plan.strategy.activation_checkpointing
    assert 30 < plan.gpu_memory.total < plan.usable_gpu_memory_gb == pytest.approx(43.2)


def test_70b_qlora_on_four_24gb_gpus_fits_with_offload_at_4k():
    _, plan = plan_for("model=llama3_1_70b", "method=qlora", "hardware=a10gx4", "train.seq_len=4096")
    s = plan.strategy
    assert plan.fits and s.engine.shards and s.offload_params and s.offload_optimizer
    # offload moves the divided weights to the host; the NF4 constants and the gathered layers stay
    assert 1.086 + 0.86 < plan.gpu_memory.weights < 4.1
    assert any(r.startswith("parameter, gradient and optimizer offload to CPU: 24.") for r in plan.reasons)
    assert plan.gpu_memory.total < plan.usable_gpu_memory_gb == pytest.approx(21.6)


def test_405b_qlora_on_eight_h100s():
    cfg, plan = plan_for("model=llama3_1_405b", "method=qlora", "hardware=h100x8", "train.seq_len=2048")
    assert plan.params_total == 405_853_388_800
    assert plan.fits and plan.strategy.engine.shards and plan.layout.world_size == 8
    job = _job(cfg, plan)
    constants = job.counts.linear * NF4_BITS / 8
    assert constants / GB == pytest.approx(6.37, abs=0.01)  # whole on each of the 8 GPUs
    assert 60 < plan.gpu_memory.total < 72.0  # of 80 GB, 10% headroom
    assert plan.host_memory_gb < plan.hardware.host_memory_gb  # 8 ranks quantize 216 GB each: 1.8 TB of 2 TB


# ---------------------------------------------------------------- the engine, sought across both


def test_engine_unset_seeks_the_fastest_across_both_engines():
    """70B full fine-tuning on 8 x B200 planned FSDP2 with everything offloaded; ZeRO-3 runs 8-bit
    AdamW with no offload."""
    _, plan = plan_for("model=llama3_1_70b", "method=full", "hardware=b200x8", "train.seq_len=8192")
    s = plan.strategy
    assert (s.sharding, s.optimizer, s.offload_optimizer, s.offload_params) == (
        "zero3",
        "adamw_8bit",
        False,
        False,
    )
    why = next(r for r in plan.reasons if r.startswith("engine: "))
    assert why.startswith(
        "engine: ZeRO-3 (train.engine unset, fsdp and zero3 weighed): FSDP2's fastest that fits is"
    )
    assert "x slower (adamw, everything offloaded" in why
    _, fixed = plan_for("model=llama3_1_70b", "method=full", "hardware=b200x8", "train.seq_len=8192",
                        "train.engine=fsdp")  # fmt: skip
    f = fixed.strategy
    assert (f.sharding, f.offload_optimizer, f.offload_params) == ("fsdp", True, True)  # honoured as given
    assert not any(r.startswith("engine: ") for r in fixed.reasons)
    assert plan.estimate.tokens_per_second > 1.4 * fixed.estimate.tokens_per_second


def test_engines_that_tie_go_to_the_first_listed_and_say_so():
    _, plan = plan_for("+recipe=llama70b_lora")
    assert plan.strategy.sharding == "fsdp"
    why = next(r for r in plan.reasons if r.startswith("engine: "))
    assert "ZeRO-3 fits as fast (" in why and why.endswith("FSDP2 is listed first")


def test_an_unknown_engine_is_refused_in_one_line():
    from finetune.core.errors import ConfigError

    with pytest.raises(ConfigError, match="train.engine"):
        compose(["train.engine=megatron"])


# ---------------------------------------------------------------- the allocator's share


def test_allocator_share_scales_with_what_a_step_allocates_not_the_frozen_base():
    cfg, plan = plan_for(
        "model=llama3_1_70b", "method=lora", "hardware=b200", "train.seq_len=8192", "method.optimizer=adamw_8bit",
        "train.activation_checkpointing=true", "train.micro_batch_size=1",
    )  # fmt: skip
    job = _job(cfg, plan)
    s = plan.strategy
    rt = runtime(job, s)
    mem = plan.gpu_memory
    above = MEMORY.working_set(job, s, rt) / GB - mem.logits
    grads = 4 * 207_093_760 / GB  # the fp32 adapters' gradients, allocated every backward
    fluctuating = mem.activations + mem.logits + above + grads
    assert MEMORY.fluctuating(job, s, rt) / GB == pytest.approx(fluctuating)
    # the packed rows' mask biases above the loss peak are the attention term, beside the overhead
    assert mem.overhead + mem.attention == pytest.approx(
        CAL.cuda.fixed_gb + above + CAL.cuda.allocator_fraction * fluctuating
    )
    # the 141 GB frozen base adds nothing to the overhead: the allocator's share is of what a step allocates and frees
    assert mem.overhead < 8.0 and mem.weights > 141
    # 163.1 GB: 16.9 GB of the 180 GB free, but above the 162 GB usable with plan.headroom's 10%
    assert mem.total == pytest.approx(163.1, abs=0.1) and not plan.fits


def test_zero3_gradients_live_in_a_buffer_allocated_once():
    cfg, plan = plan_for("model=llama3_1_70b", "method=full", "hardware=b200x8", "train.seq_len=8192")
    job = _job(cfg, plan)
    assert plan.strategy.sharding == "zero3"
    assert MEMORY.step_gradients(job, plan.strategy, runtime(job, plan.strategy)) == 0.0
    s = Strategy(sharding="fsdp", activation_checkpointing=True, micro_batch_size=1)
    assert MEMORY.step_gradients(job, s, runtime(job, s)) == pytest.approx(4 * job.counts.total / 8)


# ---------------------------------------------------------------- suggestions that shard


def test_70b_qlora_on_one_24gb_gpu_suggests_sharding_it_across_a_node_of_them():
    _, plan = plan_for("model=llama3_1_70b", "method=qlora", "hardware=l4")
    assert not plan.fits
    shard = next(s for s in plan.suggestions if s.startswith("hardware.gpus_per_node="))
    _, two = plan_for("model=llama3_1_70b", "method=qlora", "hardware=l4", "hardware.gpus_per_node=2")
    assert two.fits
    offload = ", everything offloaded" if two.strategy.offload_params else ""
    assert shard == (
        f"hardware.gpus_per_node=2 fits: {two.strategy.engine.short} across 2 x l4{offload}, "
        f"{two.gpu_memory.total:.1f} GB per GPU"
    )


def test_a_fixed_unsharded_engine_is_told_the_sharded_one_fits():
    _, plan = plan_for("model=llama3_1_70b", "method=qlora", "hardware=a10gx4", "train.sharding=ddp")
    assert not plan.fits
    _, sharded = plan_for("model=llama3_1_70b", "method=qlora", "hardware=a10gx4")
    e = sharded.strategy.engine
    assert not sharded.strategy.offload_params
    assert (
        f"train.sharding={e.key} fits: {e.short} across the 4 GPUs of a10gx4, {sharded.gpu_memory.total:.1f} GB per GPU"
        in plan.suggestions
    )


# ---------------------------------------------------------------- the 24 GB profiles


def test_24gb_profiles_carry_datasheet_facts_pcie_and_no_price():
    facts = {  # name: (gpus, GB per GPU, memory TB/s, dense bf16 TFLOP/s, host GB)
        "rtx4090": (1, 24, 1.008, 165, None), "l4": (1, 24, 0.3, 121, None), "a10gx4": (4, 24, None, None, 206),
    }  # fmt: skip
    for name, (gpus, gb, tb_s, tflops, host) in facts.items():
        hw = compose([f"hardware={name}"]).hardware
        assert (hw.total_gpus, hw.gpu_memory_gb, hw.hbm_tb_per_s, hw.peak_bf16_tflops) == (
            gpus,
            gb,
            tb_s,
            tflops,
        )
        assert (hw.host_memory_gb, hw.interconnect, hw.usd_per_month) == (host, "pcie", None), name
        assert len(hw.gpu_names) == 1, name
