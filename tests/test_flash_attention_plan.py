"""flash-attn (`train.attention=flash`) without a sequence split builds no mask: the collator flattens the packed
rows and its variable-length kernel reads the samples' bounds from position_ids. The plan counts SDPA's [T, T]
bias per layer only on the SDPA path."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import planned

from finetune.planner.job import make_job, runtime
from finetune.planner.memory import memory
from finetune.planner.step import activations, mask_bias

T = 8192


def job_and_strategy(attention: str):
    cfg, plan = planned(
        "model=llama3_1_8b",
        "method=lora",
        "hardware=h100",
        f"train.seq_len={T}",
        f"train.attention={attention}",
    )
    s = replace(plan.strategy, activation_checkpointing=False, micro_batch_size=1, sequence_parallel=1)
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, T, objective=cfg.objective.spec)
    return job, s


def test_flash_attention_holds_no_mask_bias_where_sdpa_holds_one_a_layer():
    sdpa_job, sdpa = job_and_strategy("sdpa")
    flash_job, flash = job_and_strategy("flash")
    assert sdpa.attention == "sdpa" and flash.attention == "flash"
    sdpa_rt, flash_rt = runtime(sdpa_job, sdpa), runtime(flash_job, flash)
    assert sdpa_rt.packed and not flash_rt.packed
    # SDPA: the packed rows' additive bias, [T, T] in bf16, per layer (134 MB at 8,192 tokens)
    assert mask_bias(sdpa_job, sdpa, sdpa_rt) == T * T * 2 == 134_217_728
    m = sdpa_job.model
    # and repeat_kv's copies of k and v for every head, which flash-attn's grouped kernel does not make
    repeat_kv = 2 * 2 * (m.num_heads - m.num_kv_heads) * m.head_dim * T
    held = activations(sdpa_job, sdpa, sdpa_rt) - activations(flash_job, flash, flash_rt)
    assert held == m.num_layers * (134_217_728 + repeat_kv)
    # the plan's terms: the activations differ by those bytes, and flash-attn has no attention workspace
    sdpa_mem, flash_mem = memory(sdpa_job, sdpa)[0], memory(flash_job, flash)[0]
    assert (sdpa_mem.activations - flash_mem.activations) * 1e9 == pytest.approx(held, abs=1)
    assert flash_mem.attention == 0.0
