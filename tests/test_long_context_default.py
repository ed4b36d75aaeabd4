"""Long context by default: the planner chooses the attention path with the sequence split, names it, and
counts its workspace as its own term (`attention`), apart from the overhead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import child_env, planned, run_cli

from finetune.planner import Plan
from finetune.planner.activations import attention_mask_bytes
from finetune.planner.attention import block_mask_bytes
from finetune.planner.calibration import Calibration

GB = 1e9
CAL = Calibration.default()
LONG = ("+recipe=llama8b_lora_128k",)


def test_llama8b_lora_at_128k_fits_8xh100_without_train_attention():
    cfg, plan = planned(*LONG)
    s = plan.strategy
    assert cfg.train.attention is None  # the recipe leaves the path to the planner
    assert plan.fits and plan.hardware.name == "h100x8" and plan.seq_len == 131_072
    # packed rows on one GPU: FlexAttention's block mask, no [T, T] bias and no split needed
    assert (s.attention, s.sequence_parallel) == ("flex", 1)
    assert (
        "attention: FlexAttention (a block mask from the packed rows' position_ids, no [T, T] tensor) "
        "(train.attention unset)"
    ) in plan.reasons
    # its workspace is the block mask alone: 4 int32 tensors of 1,024 x 1,024 blocks (modelled)
    assert block_mask_bytes(tokens=131_072, rows=1) == 4 * 4 * 1024 * 1024
    assert plan.gpu_memory.attention * GB == pytest.approx(16_777_216)
    d = plan.to_dict()
    assert d["strategy"]["attention"] == "flex" and d["gpu_memory_gb"]["attention"] == 0.017
    assert Plan.from_dict(json.loads(json.dumps(d))).strategy == s


def test_sdpa_s_mask_at_128k_is_the_attention_term_not_overhead():
    _, plan = planned(*LONG, "train.attention=sdpa", "train.sequence_parallel=1")
    mem = plan.gpu_memory
    assert not plan.fits and plan.strategy.attention == "sdpa"
    # the bf16 [T, T] bias of the layer in backward and of the one being recomputed: 45 GB
    bias = attention_mask_bytes(tokens=131_072, rows=1)
    assert bias == 2 * 131_072**2
    assert mem.attention * GB == pytest.approx(bias * (1 + CAL.cuda.backward_working_set_layers))
    assert mem.attention == pytest.approx(45.0, abs=0.1) and mem.attention > mem.overhead / 2
    assert (
        "attention: SDPA with the packed rows' block-diagonal mask (a [T, T] bias a layer) (train.attention)"
        in (plan.reasons)
    )


def test_the_split_runs_sdpa_without_a_mask_where_rows_are_not_packed():
    _, plan = planned(
        *LONG, "data.packing=false", "train.sequence_parallel=2", "train.sequence_split=ulysses"
    )
    s = plan.strategy
    assert plan.fits and (s.attention, s.sequence_parallel, s.sequence_split) == ("sdpa", 2, "ulysses")
    assert plan.gpu_memory.attention == 0.0
    assert (
        "attention: SDPA without a mask (the sequence split takes causality from position_ids: its flash "
        "kernel) (train.attention unset)"
    ) in plan.reasons


def test_short_and_cpu_plans_keep_sdpa_and_their_bytes():
    # below the long-context length the measured SDPA path stays the default, byte for byte
    _, unset = planned("+recipe=llama8b_lora", "train.seq_len=8192")
    _, sdpa = planned("+recipe=llama8b_lora", "train.seq_len=8192", "train.attention=sdpa")
    assert unset.strategy.attention == "sdpa"
    assert unset.gpu_memory == sdpa.gpu_memory
    assert not any(r.startswith("attention:") for r in unset.reasons)
    # the CPU runs SDPA (FlexAttention has no backward there)
    _, cpu = planned("+recipe=tiny")
    _, cpu_sdpa = planned("+recipe=tiny", "train.attention=sdpa")
    assert cpu.strategy.attention == "sdpa" and cpu.gpu_memory == cpu_sdpa.gpu_memory
    assert cpu.gpu_memory.attention > 0  # the tiny packed rows' mask biases, as measured before


def test_the_128k_recipe_plans_from_the_command_line_and_names_its_path(tmp_path: Path):
    out = tmp_path / "plan.json"
    r = run_cli(
        "+recipe=llama8b_lora_128k", "mode=plan", f"plan.out={out}", f"run_dir={tmp_path / 'run'}",
        env=child_env(COLUMNS="120"), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert plan["fits"] is True and plan["hardware"]["name"] == "h100x8"
    assert plan["strategy"]["attention"] == "flex" and plan["strategy"]["sequence_parallel"] == 1
    # the attention path's workspace is its own term, and the total is the sum of the terms
    terms = plan["gpu_memory_gb"]
    assert terms["attention"] == 0.017
    assert terms["total"] == pytest.approx(sum(v for k, v in terms.items() if k != "total"), abs=0.01)
    assert "FITS" in r.stdout and "│ attention" in r.stdout
    assert (
        "attention: FlexAttention (a block mask from the packed rows' position_ids, no [T, T] tensor) "
        in r.stdout
    )


def test_the_split_takes_the_plans_sequence_length_when_the_data_stage_resolved_auto(tmp_path: Path):
    """plan.json owns the resolved sequence length: a split's handler reads it there, not `train.seq_len`."""
    from finetune.core.composition import compose
    from finetune.launch.engines import write_engine_files
    from finetune.pipeline.stages import config_plan, resolve

    cfg = resolve(
        compose([*LONG, "train.seq_len=auto", "data.packing=false", "train.sequence_parallel=2",
                 "train.sequence_split=ulysses"])
    )  # fmt: skip
    plan = config_plan(cfg, cfg.hardware, 65_536)  # what the data stage resolved `auto` to
    assert plan.seq_len == 65_536 and plan.strategy.sequence_parallel == 2
    files = write_engine_files(cfg, plan, tmp_path)
    assert files.parallelism is not None and files.parallelism["seq_len"] == 65_536
    assert json.loads((tmp_path / "engine.json").read_text())["parallelism"]["seq_len"] == 65_536
