"""The plan of a reward model (a score head in place of the LM head) against a measured CPU training step.

A step of TRL's RewardTrainer on the tiny model as finetune loads it (a one-label sequence classifier, LoRA with
the score head trained in full, or full fine-tuning), with the state a step in progress holds (gradients, Adam
moments), measured as scripts/bench_planner.py measures SFT and DPO: the distinct storages held, plus the peak
of live tensor bytes through the forward and backward (allocated bytes, not resident pages).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import planned, script_module

from finetune.core.objectives import OBJECTIVES
from finetune.planner import Strategy, make_job, memory, tensors_gb
from finetune.planner.job import runtime
from finetune.planner.params import count_params

PAIRS, TOKENS = 4, 64


def _measured_step(cfg) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Bytes of one measured step: the weights, the training state, and the total peak."""
    import torch
    import torch.nn.functional as F

    from finetune.modeling.loading import load_for_training

    bench = script_module("bench_planner")
    torch.manual_seed(0)
    model, _ = load_for_training(cfg)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False)
    for p in trainable:  # the held state of a step in progress, as bench_planner.measure makes it
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)
    params = list(model.parameters())
    grads = [p.grad for p in trainable]
    state = bench.optimizer_state_tensors(opt)
    held = bench.storage_bytes(params + grads + state + list(model.buffers()))
    full = cfg.method.spec.trains_base_weights
    weights = bench.storage_bytes(params if full else [p for p in params if not p.requires_grad])
    trainable_state = bench.storage_bytes(([] if full else trainable) + grads + state)
    # TRL's reward collator: the chosen rows, then the rejected ones (shorter, right-padded)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.model.vocab_size, (2 * PAIRS, TOKENS), generator=g)
    mask = torch.ones_like(ids)
    mask[PAIRS:, TOKENS - TOKENS // 8 :] = 0
    ids[PAIRS:, TOKENS - TOKENS // 8 :] = 0
    with bench.LiveBytes() as live:  # RewardTrainer.compute_loss
        scores = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.squeeze(-1)
        chosen, rejected = scores.chunk(2)
        (-F.logsigmoid(chosen - rejected).mean()).backward()
    return dict(weights=weights, trainable_state=trainable_state, total=held + live.peak)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_plan_of_a_reward_model_step_is_within_5_percent_of_the_measured_one(method):
    # dropout off, as TRL's RewardTrainer turns it off (disable_dropout)
    cfg, _ = planned(
        "+recipe=tiny_reward", f"method={method}", "method.lora_dropout=0", f"train.seq_len={TOKENS}"
    )
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, TOKENS, objective=OBJECTIVES["reward"])
    s = Strategy(activation_checkpointing=False, chunked_loss=False, micro_batch_size=PAIRS)
    rt = replace(runtime(job, s), resident=False)  # allocated bytes, as measured
    mem, _ = memory(job, s, rt)
    measured = _measured_step(cfg)
    # parameters and their training state to the byte (the optimizer's step counters aside)
    assert measured["weights"] == mem.weights * 1e9
    assert measured["trainable_state"] == pytest.approx(mem.trainable_state * 1e9, rel=1e-3)
    assert measured["total"] == pytest.approx(tensors_gb(job, s, rt) * 1e9, rel=0.05)


def test_a_score_head_replaces_the_lm_head_in_the_counts_and_the_loss():
    cfg, plan = planned("+recipe=tiny_reward", "method=lora")
    _, dpo = planned(
        "+recipe=tiny_reward", "method=lora", "objective=dpo"
    )  # the same pairs through an LM head
    h, vocab = cfg.model.hidden_size, cfg.model.vocab_size
    reward = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, 64, objective=OBJECTIVES["reward"])
    lm = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, 64, objective=OBJECTIVES["dpo"])
    # the tiny model's untied 512 x 128 LM head becomes a 1 x 128 score head, trained in full beside LoRA
    assert reward.counts.total == count_params(cfg.model).total - vocab * h + h
    assert reward.adapter == lm.adapter + h
    # no vocabulary logits: the loss term is the scores, the last-token search and the hidden states' gradient
    s = Strategy(micro_batch_size=8)
    rt = runtime(reward, s)
    assert memory(reward, s, rt)[0].logits * 1e9 == pytest.approx(16 * 64 * (4 + 16 + 4 * h))
    assert plan.strategy.micro_batch_size == dpo.strategy.micro_batch_size == 32
    assert plan.gpu_memory.logits < 0.05 * dpo.gpu_memory.logits
    assert "loss: a score head (one value a sequence, no vocabulary logits) (the default)" in plan.reasons
