"""The plan of ORPO's and SimPO's step against what TRL's trainers really hold on the CPU.

One step of the real trainer (finetune/train/orpo_trainer.py, cpo_trainer.py on TRL's ORPOTrainer and
CPOTrainer) on the tiny model with LoRA: the bytes held before it (weights, adapters, their gradients, Adam's
moments) plus the peak of the bytes its forward and backward allocate (scripts/bench_planner.py's `LiveBytes`),
against the planner's tensors for the same shape (no reference model: none is loaded, none planned). The pairs
fill `train.seq_len` (the longer side), as the plan assumes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import planned_run_dir, script_module, write_engine

from finetune.planner import memory, tensors_gb
from finetune.planner.job import make_job, runtime

GB = 1e9


def measured_step(cfg, plan, run_dir, pairs: int, tokens: int) -> float:
    from datasets import Dataset

    from finetune.modeling import loading, models
    from finetune.train.base_trainer import build_trainer

    bench = script_module("bench_planner")
    torch.manual_seed(0)
    model, dtype = loading.load_for_training(cfg, sharded=False)
    g = torch.Generator().manual_seed(1)
    prompt = tokens // 4
    rows = [
        {
            "prompt_ids": torch.randint(5, 500, (prompt,), generator=g).tolist(),
            "chosen_ids": torch.randint(5, 500, (tokens - prompt,), generator=g).tolist(),
            "rejected_ids": torch.randint(5, 500, (tokens - prompt - 8,), generator=g).tolist(),
        }
        for _ in range(pairs)
    ]
    tokenizer = models.load_tokenizer(cfg.model)
    trainer = build_trainer(cfg, plan, run_dir, model, tokenizer, Dataset.from_list(rows), None, dtype, [])
    model = trainer.model
    batch = trainer._prepare_inputs(trainer.data_collator(rows))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False)
    for p in trainable:  # the state of a step in progress: gradients and Adam's moments held
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)
    held = bench.storage_bytes(
        list(model.parameters())
        + [p.grad for p in trainable]
        + bench.optimizer_state_tensors(opt)
        + list(model.buffers())
    )
    with bench.LiveBytes() as live:
        trainer.compute_loss(model, batch).backward()
    return held + live.peak


@pytest.mark.slow  # the first case builds the tiny model: ~30 s on 2 loaded cores
@pytest.mark.parametrize(
    "objective, precision, pairs, tokens",
    [("orpo", "fp32", 32, 64), ("orpo", "bf16", 16, 48), ("simpo", "fp32", 16, 48)],
)
def test_planned_step_within_5_percent_of_the_measured_one(
    tmp_path, tiny_cache, objective, precision, pairs, tokens
):
    cfg, plan, run_dir = planned_run_dir(
        tmp_path, f"+recipe=tiny_{objective}", f"method.precision={precision}", f"train.seq_len={tokens}"
    )
    plan = replace(plan, strategy=replace(plan.strategy, micro_batch_size=pairs, grad_accum_steps=1))
    write_engine(cfg, plan, run_dir)
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, tokens, objective=cfg.objective.spec)
    # allocated bytes (what LiveBytes counts), not the resident pages of a run's peak RSS
    rt = replace(runtime(job, plan.strategy), resident=False)
    mem, _ = memory(job, plan.strategy, rt)
    assert mem.weights * GB == pytest.approx(
        4 * 1_229_952 - 4 * 311_296 if precision == "fp32" else 2 * (1_229_952 - 311_296), rel=0.02
    )  # the frozen base only: no reference copy
    measured = measured_step(cfg, plan, run_dir, pairs, tokens)
    assert tensors_gb(job, plan.strategy, rt) * GB == pytest.approx(measured, rel=0.05)
