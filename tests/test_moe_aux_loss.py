"""The router's load-balancing loss: on the chunked loss path the model's own `aux_loss` (transformers'
load_balancing_loss_func with the model's arguments), added by the trainer weighted by router_aux_loss_coef as
TRL adds it on its own path, and reported in metrics.json."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import EXPERT_LORA, TINY_MIXTRAL, TINY_MOE, last_losses, tiny_cfg, tiny_model, train_run

from finetune.modeling import tiny
from finetune.modeling.chunked_loss import add_chunked_loss_head

FAMILIES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_token=2, moe_intermediate_size=48),
    "mixtral": dict(num_experts=4, num_experts_per_token=2, intermediate_size=48, norm_topk_prob=True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chunked_loss_returns_the_model_s_own_aux_loss(tiny_cache, family):
    model = tiny.load_model(tiny_model(family, **FAMILIES[family]))
    model.config.output_router_logits = True  # what TRL's SFTTrainer sets for a mixture of experts
    add_chunked_loss_head(model, chunk_size=16)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # a padded row: the balance is over the unmasked tokens
    own = model(input_ids=ids, attention_mask=mask, labels=ids)
    ours = model(input_ids=ids, attention_mask=mask, labels=ids, chunked_loss=True)
    assert ours.aux_loss is not None and 1.0 < ours.aux_loss.detach().item() < 4.0  # about k when balanced
    assert torch.allclose(ours.aux_loss, own.aux_loss, rtol=1e-6)
    # the model's own loss includes it weighted; the chunked loss leaves the weighting to the trainer (as TRL)
    coef = model.config.router_aux_loss_coef
    assert coef == 0.001 and torch.allclose(ours.loss + coef * ours.aux_loss, own.loss, rtol=1e-5)
    ours.loss.backward()  # and the router's logits are part of the graph the trainer differentiates
    model.config.output_router_logits = False
    assert model(input_ids=ids, labels=ids, chunked_loss=True).get("aux_loss") is None


@pytest.mark.slow
@pytest.mark.parametrize("shape", [TINY_MOE, TINY_MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_both_loss_paths_train_with_the_aux_loss_and_report_it(tmp_path, tiny_cache, tiny_data, shape):
    """The chunked loss and TRL's fused head give the same first-step loss, CE + 0.001 x aux (the model's
    coefficient), and metrics.json reports the aux loss and its coefficient."""
    first, reported = {}, {}
    for chunked in (True, False):
        cfg = tiny_cfg(
            *shape,
            *EXPERT_LORA,
            "train.max_steps=2",
            "train.save_steps=1000",
            run_dir=tmp_path / f"run{chunked}",
        )
        metrics = train_run(
            cfg, tiny_data, n_train=4, n_eval=4, max_generate=1, micro_batch_size=2, grad_accum_steps=1,
            chunked_loss=chunked,
        )  # fmt: skip
        first[chunked] = last_losses(Path(metrics["train"]["output_dir"]).parent)[0]
        reported[chunked] = metrics["train"]
    assert first[True] == pytest.approx(first[False], rel=2e-3)
    for train in reported.values():
        assert train["router_aux_loss_coef"] == 0.001
        assert math.isfinite(train["final_aux_loss"]) and 1.0 < train["final_aux_loss"] < 4.0
