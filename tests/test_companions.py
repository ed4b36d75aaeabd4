"""Frozen companion models beside the policy, as the planner counts them: any objective's `companions` function
is resolved and planned with no other change (a reward model with a score head is defined here, as an
objective's module would), each companion is its own named term in plan.json and the plan table, its weights
are divided like the policy's where the engine shards, and its forward's planned peak is what a CPU forward
really allocates."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import planned, script_module

from finetune.core.objectives import OBJECTIVES, Companion
from finetune.modeling import companions as resolving
from finetune.modeling import tiny
from finetune.planner.companions import CompanionShape, flops_per_token, forward_peak
from finetune.planner.contract import GB, Memory, Plan
from finetune.planner.job import make_job, micro_batch_rows, runtime
from finetune.planner.timing import executed_flops_per_token


def reward_model(settings: object) -> tuple[Companion, ...]:
    """A learned reward model beside the policy: its shape is the tiny preset's, its head one value a sequence."""
    return (Companion("reward_model", "tiny", head="score"),)


@pytest.fixture
def scored_sft(monkeypatch):
    """SFT with this module's reward model beside it, registered in the objective table only."""
    spec = replace(OBJECTIVES["sft"], companions=f"{__name__}:reward_model")
    monkeypatch.setitem(OBJECTIVES, "sft", spec)
    return spec


def test_any_objectives_companion_is_its_own_term(scored_sft):
    cfg, plan = planned("hardware=cpu", "train.seq_len=128")
    (shape,) = resolving.shapes(cfg)
    assert shape == CompanionShape("reward_model", shape.model, "score") and shape.model.num_layers == 4
    terms = dict(plan.gpu_memory.companions)
    rows = plan.strategy.micro_batch_size
    # fp32 on the CPU: every weight 4 bytes, unsharded; its forward over one micro-batch of packed rows
    # a score head of its own ([1, h]) instead of the LM head
    assert shape.params == shape.counts.total - shape.counts.lm_head + shape.model.hidden_size
    weights = 4 * shape.params
    assert terms["companion:reward_model"] == pytest.approx(
        (weights + forward_peak(shape, 4, rows, 128, packed=True, sharded=False)) / GB
    )
    # the total counts it, plan.json names it, and plan.json reads back to the same plan
    listed = plan.to_dict()["gpu_memory_gb"]
    assert listed["companion:reward_model"] == round(terms["companion:reward_model"], 3)
    assert Plan.from_dict(plan.to_dict()).gpu_memory.companions == (
        ("companion:reward_model", listed["companion:reward_model"]),
    )
    without = replace(plan.gpu_memory, companions=())
    assert plan.gpu_memory.total == pytest.approx(without.total + terms["companion:reward_model"])


def test_the_plan_table_lists_the_companion(scored_sft, capsys):
    from rich.console import Console

    from finetune.pipeline.plan_report import print_plan

    _, plan = planned("hardware=cpu", "train.seq_len=128")
    print_plan(plan, "scored", Console(width=200, force_terminal=False))
    row = next(line for line in capsys.readouterr().out.splitlines() if "companion:reward_model" in line)
    assert f"{dict(plan.gpu_memory.companions)['companion:reward_model']:,.2f}" in row


def test_a_companions_forward_is_counted_in_the_time(scored_sft):
    cfg, plan = planned("hardware=h100", "train.seq_len=128")
    (shape,) = resolving.shapes(cfg)
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, 128, objective=scored_sft)
    with_companion = replace(job, companions=(shape,))
    extra = executed_flops_per_token(with_companion, plan.strategy) - executed_flops_per_token(
        job, plan.strategy
    )
    # a forward: 2 FLOPs a weight a token (not the embedding, a lookup) and causal attention
    m, counts = shape.model, shape.counts
    # the decoder layers' projections and the score head, 2 FLOPs a weight; causal attention
    assert (
        extra
        == flops_per_token(shape, 128)
        == pytest.approx(
            2 * (counts.linear + m.hidden_size) + 2 * m.num_layers * 128 * m.num_heads * m.head_dim
        )
    )


@pytest.mark.parametrize("sharding", ["fsdp", "zero3"])
def test_a_companion_is_sharded_like_the_policy(scored_sft, sharding):
    cfg, plan = planned("hardware=h100x8", "train.seq_len=1024", f"train.sharding={sharding}")
    (shape,) = resolving.shapes(cfg)
    s = plan.strategy
    assert s.sharding == sharding and s.engine.shards
    job = replace(
        make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, 1024, objective=scored_sft),
        companions=(shape,),
    )
    rt = runtime(job, s)
    assert rt.compute == 2  # bf16 on the GPUs
    rows = micro_batch_rows(job, s)
    forward = forward_peak(shape, 2, rows, 1024, packed=True, sharded=True)
    # every weight in bf16 over the 8 ranks, plus one gathered layer in the forward
    expected = 2 * shape.params / 8 + forward
    assert dict(plan.gpu_memory.companions)["companion:reward_model"] == pytest.approx(expected / GB)
    assert (
        forward - forward_peak(shape, 2, rows, 1024, packed=True, sharded=False) == 2 * shape.counts.per_layer
    )


def test_memory_without_companions_reads_old_plans():
    assert Memory.from_dict(
        {
            "weights": 1,
            "trainable_state": 2,
            "activations": 3,
            "logits": 4,
            "attention": 0,
            "overhead": 1,
            "total": 11,
        }
    ) == Memory(1, 2, 3, 4, 0, 1)


# (rows, seq_len, packed, vocab, dtype): the layer's tensors peak (the tiny model's vocabulary is narrow), or the
# head's (a wider vocabulary); fp32 and bf16; packed rows with their mask, or one sequence a row.
FORWARDS = [
    (4, 256, True, 512, torch.float32),
    (4, 256, False, 512, torch.float32),
    (1, 512, True, 512, torch.bfloat16),
    (2, 128, True, 4096, torch.float32),
]


@pytest.mark.parametrize("rows,seq_len,packed,vocab,dtype", FORWARDS)
def test_the_planned_forward_is_what_a_cpu_forward_allocates(rows, seq_len, packed, vocab, dtype):
    """The frozen forward (under no_grad, as the trainer runs a teacher) of the tiny model, its live bytes
    counted as ops make and free them (scripts/bench_planner.py's LiveBytes): the plan within 5%."""
    cfg, _ = planned("hardware=cpu")
    model_cfg = replace(cfg.model, vocab_size=vocab)
    model = tiny.load_model(model_cfg, dtype=dtype).eval()
    ids = torch.randint(0, vocab, (rows, seq_len))
    positions = torch.arange(seq_len).repeat(rows, 1)
    if packed:  # two samples a row
        half = seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).repeat(rows, 1)
    live = script_module("bench_planner").LiveBytes()
    with torch.no_grad(), live:
        model(input_ids=ids, position_ids=positions, use_cache=False)
    compute = 2 if dtype == torch.bfloat16 else 4
    shape = CompanionShape("teacher", model_cfg)
    assert forward_peak(shape, compute, rows, seq_len, packed, sharded=False) == pytest.approx(
        live.peak, rel=0.05
    )
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert compute * shape.counts.total == held
