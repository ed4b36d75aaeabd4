"""The vision encoder's activations as a plan term (`vision_activations`), against what the tiny VLM's training
step really saves and holds on the CPU (scripts/measure_vision_activations.py): a frozen tower, LoRA on the
encoder (`method.lora_vision`) and full fine-tuning, with and without activation checkpointing."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import planned, script_module

from finetune.pipeline.plan_report import print_plan
from finetune.planner.job import make_job, runtime
from finetune.planner.memory import memory
from finetune.planner.step import vision_activations

VLM = "+recipe=tiny_vlm"


def planned_bytes(*overrides: str, checkpointing: bool = False) -> float:
    cfg, plan = planned(VLM, *overrides)
    s = replace(plan.strategy, activation_checkpointing=checkpointing)
    job = make_job(
        cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.train.seq_len, objective=cfg.objective.spec
    )
    return vision_activations(job, s, runtime(job, s))


# The tiny VLM's recipe (8 pictures of 64 patches a micro-batch, a 2-layer encoder of width 64, fp32 on the CPU):
# the bytes its encoder kept in a real step (measured through the trainer as the slow test below measures).
MEASURED_RECIPE = [
    (("method.lora_vision=false",), False, 0),  # frozen: nothing needs its gradient
    # the inputs' require-grad hook runs a gradient through the frozen tower: each layer's input, the final norm's
    (("method.lora_vision=false",), True, 8 * 64 * (2 * 4 * 64 + 4 * 64 + 8)),
    (("method.lora_vision=true",), False, 4_096_000),
    (("method.lora_vision=true",), True, 528_384),
    (("method=full",), False, 3_842_048),
]


@pytest.mark.parametrize("overrides, checkpointing, measured", MEASURED_RECIPE)
def test_the_recipes_encoder_term_is_the_measured_bytes(overrides, checkpointing, measured):
    assert planned_bytes(*overrides, checkpointing=checkpointing) == measured


def test_the_term_is_named_in_the_plan_and_its_table(capsys):
    cfg, plan = planned(VLM)
    terms = plan.to_dict()["gpu_memory_gb"]
    assert terms["vision_activations"] == round(4_096_000 / 1e9, 3) == 0.004
    assert terms["total"] == pytest.approx(sum(v for k, v in terms.items() if k != "total"), abs=0.003)
    print_plan(plan, title="tiny_vlm")
    assert "vision_activations" in capsys.readouterr().out
    assert "the encoder's activations are planned" in " ".join(plan.reasons)
    # a text model's plan has no encoder: the term is 0 and its table has no such row
    _, text = planned("+recipe=tiny")
    assert text.gpu_memory.vision_activations == 0.0
    print_plan(text, title="tiny")
    assert "vision_activations" not in capsys.readouterr().out


def test_a_frozen_tower_keeps_nothing_without_checkpointing_whatever_the_batch():
    cfg, plan = planned(VLM, "method.lora_vision=false", "train.batch_size=32")
    job = make_job(
        cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.train.seq_len, objective=cfg.objective.spec
    )
    mem, _ = memory(job, plan.strategy)
    assert mem.vision_activations == 0.0


@pytest.mark.slow  # six CPU steps of a tiny VLM with a 4-layer encoder: about 2 minutes on 2 loaded cores
@pytest.mark.parametrize("case", list(script_module("measure_vision_activations").CASES))
def test_planned_step_within_5_percent_of_the_measured_one(tiny_cache, case):
    bench = script_module("measure_vision_activations")
    overrides, checkpointing = bench.CASES[case]
    r = bench.measure((*bench.SHAPE, *overrides), checkpointing)
    if case.endswith("bf16"):
        # autocast's bf16 copies of the encoder's fp32 adapters and projector: counted with the others
        # (`adapter_copies`), not in this term
        assert r["encoder_planned"] == pytest.approx(r["encoder_saved"], rel=0.02)
    else:
        assert r["encoder_planned"] == r["encoder_saved"]
    assert r["step_planned"] == pytest.approx(r["step"], rel=0.05)
    if case in ("lora_vision", "full"):
        assert r["vision_share"] > 0.25  # the encoder is a good share of what the check holds to 5%


def test_qwen25vl_towers_saved_bytes_are_the_planned_ones():
    """Qwen2.5-VL's vision tower (no torchvision needed without its processor), every weight trained in fp32:
    its fused qkv, rotary, windowed SDPA, gated MLP and patch merger, to the byte."""
    r = script_module("measure_vision_activations").measure_qwen25vl_tower()
    assert r["measured"] == r["planned"] == 2_165_760
