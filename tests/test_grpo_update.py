"""One hand-built GRPO group through the training stage's own path, from `init_from`'s adapter: the update
goes the way the reward says.

Why: from a tiny SFT start GRPO drives every sentiment answer to one label while the training
reward rises (BENCHMARKS.md, "DPO and GRPO on the tiny model (CPU)"). These are the checks that
rule a bug in our path out: the model is init_from's adapter, trainable, and the one generation uses; TRL's
group advantages have the reward's signs; TRL's per-token log-probabilities (its fused LM head, left-padded
prompts, no position ids) equal a plain forward of each row alone; one step of the run's own optimizer
raises log p(rewarded answer) and lowers log p(the other); with `objective.beta > 0` the KL reference is a frozen
copy of init_from's adapter (TRL 1.16's "ref" adapter), not the base without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SHORT_RUN, make_adapter_run, planned_run_dir, write_engine

from finetune.core import tasks

# tiny_grpo's groups and rewards (exact match + 0.2 x a one-word answer)
GROUP = (
    "objective=grpo",
    "train.batch_size=8",
    "objective.num_generations=4",
    "objective.max_completion_length=4",
    r"objective.rewards=[exact_match,'format:\w+']",
    "objective.reward_weights=[1.0,0.2]",
)


def _trainer(tmp_path: Path, *overrides: str) -> tuple[Any, Any]:
    """The GRPO trainer as the training stage builds it (`build_config`, `load_for_training`, `build_trainer`)
    on a run started from a saved adapter; and the rows it trains on."""
    from datasets import Dataset

    from finetune.modeling import loading, models
    from finetune.train import grpo_trainer
    from finetune.train.base_trainer import build_trainer

    sft = tmp_path / "sft"
    sft.mkdir()
    cfg, plan, run = planned_run_dir(
        tmp_path, *SHORT_RUN, *GROUP, "method.lora_dropout=0", "method.learning_rate=1e-3", *overrides
    )
    make_adapter_run(sft, cfg.model, cfg.method)
    cfg.init_from = str(sft)
    write_engine(cfg, plan, run)
    rows = Dataset.from_list(grpo_trainer.prompt_rows(tasks.generate(40, 3)))
    args = grpo_trainer.build_config(cfg, plan, run, torch.float32)
    model, dtype = loading.load_for_training(cfg)
    tokenizer = models.load_tokenizer(cfg.model)
    trainer = build_trainer(cfg, plan, run, model, tokenizer, rows, None, dtype, [], args=args)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which these checks skip
    trainer.model.train()
    return trainer, rows


def _group(trainer: Any, rows: Any, completions: dict[str, list[list[int]]]) -> dict[str, Any]:
    """TRL's scored batch for one group per reference in `completions`, its sampling replaced by those ids."""
    picked = [next(r for r in rows if r["reference"] == ref) for ref in completions]
    ids = [c for ref in completions for c in completions[ref]]
    trainer._generate_single_turn = lambda *args: ([list(c) for c in ids], None)
    return trainer._generate_and_score_completions([dict(r) for r in picked for _ in range(4)])


def _plain_log_probs(model: Any, batch: dict[str, Any]) -> list[list[float]]:
    """log p of each completion token from a forward of its row alone: no padding, default positions."""
    out = []
    with torch.no_grad():
        for prompt, pmask, completion, cmask in zip(
            batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
        ):
            row = torch.cat([prompt[pmask.bool()], completion[cmask.bool()]])
            log_probs = torch.log_softmax(model(input_ids=row[None]).logits[0, :-1].float(), -1)
            taken = log_probs.gather(-1, row[1:, None])[:, 0]
            out.append(taken[-int(cmask.sum()) :].tolist())
    return out


def _trl_log_probs(trainer: Any, batch: dict[str, Any]) -> torch.Tensor:
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        log_probs, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, mask, batch["completion_ids"].size(1)
        )
    return log_probs


def test_a_rewarded_answer_gains_probability_through_the_stages_trainer(
    tiny_cache: Path, tmp_path: Path
) -> None:
    trainer, rows = _trainer(tmp_path)
    model, tokenizer = trainer.model, trainer.processing_class
    neg, pos, end, mark = tokenizer.convert_tokens_to_ids(["negative", "positive", "<|end|>", "?"])
    assert trainer.eos_token_ids == [end]
    # init_from's adapter is what trains and what samples: the model the trainer holds, its LoRA trainable
    assert list(model.peft_config) == ["default"]
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n) > 0
    assert trainer.beta == 0.0 and trainer.scale_rewards == "group"

    # Two groups, prompts of different lengths (left padding): "negative" right on the first, wrong on
    # the second; completions of 2 and 3 tokens (right padding), "positive?" not one word.
    batch = _group(
        trainer,
        rows,
        {
            "negative": [[neg, end], [neg, end], [pos, end], [pos, mark, end]],
            "positive": [[neg, end], [pos, end], [pos, end], [pos, end]],
        },
    )
    # exact match + 0.2 x one word, centred and scaled by each group's spread (TRL's scale_rewards="group")
    rewards = torch.tensor([[1.2, 1.2, 0.2, 0.0], [0.2, 1.2, 1.2, 1.2]])
    expected = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    assert batch["advantages"].tolist() == pytest.approx(expected.flatten().tolist(), abs=1e-4)
    assert expected[0, 0] > 0 > expected[1, 0]
    assert batch["completion_mask"].sum(1).tolist() == [2, 2, 2, 3, 2, 2, 2, 2]
    assert batch["prompt_mask"].sum(1).unique().numel() == 2  # two prompt lengths, left-padded
    trl = _trl_log_probs(trainer, batch)
    for i, plain in enumerate(_plain_log_probs(model, batch)):
        assert trl[i, : len(plain)].tolist() == pytest.approx(plain, abs=1e-5)

    # One step of the run's own optimizer (AdamW at method.learning_rate) on the first group alone
    batch = _group(trainer, rows, {"negative": [[neg, end], [neg, end], [pos, end], [pos, end]]})
    assert batch["advantages"].tolist() == pytest.approx([0.866, 0.866, -0.866, -0.866], abs=1e-3)
    before = _trl_log_probs(trainer, batch)[:, 0]
    trainer.create_optimizer()  # the run's AdamW at its full rate (the scheduler would start it at 0: warmup)
    trainer.optimizer.zero_grad()
    trainer.compute_loss(model, batch).backward()
    trainer.optimizer.step()
    after = _trl_log_probs(trainer, batch)[:, 0]
    assert after[0] > before[0] + 0.01  # log p("negative" | a negative sentence) rose
    assert after[2] < before[2] - 0.01  # log p("positive" | it) fell


def test_a_kl_term_anchors_to_the_init_from_adapter(tiny_cache: Path, tmp_path: Path) -> None:
    trainer, rows = _trainer(tmp_path, "objective.beta=0.04")
    model = trainer.model
    # TRL copies the loaded adapter into a frozen "ref" adapter: the reference is the SFT start itself
    assert sorted(model.peft_config) == ["default", "ref"]
    params = dict(model.named_parameters())
    ref = {n: p for n, p in params.items() if ".ref." in n}
    assert ref and not any(p.requires_grad for p in ref.values())
    for name, param in ref.items():
        assert torch.equal(param, params[name.replace(".ref.", ".default.")])
    neg, pos, end = trainer.processing_class.convert_tokens_to_ids(["negative", "positive", "<|end|>"])
    batch = _group(trainer, rows, {"negative": [[neg, end], [neg, end], [pos, end], [pos, end]]})
    # before any step the policy is its reference: the KL term starts at 0
    assert torch.allclose(batch["ref_per_token_logps"], _trl_log_probs(trainer, batch), atol=1e-6)
