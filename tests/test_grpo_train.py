"""GRPO through TRL on the tiny model, bf16 on the CPU, one process, transformers' generation in the trainer.

The values checked: TRL's logged reward means are the means of what our rewards returned for the
completions it sampled; a reward with spread within a group gives a non-zero loss and moves the adapter;
a reward that raises mid-training stops `train()` with one line naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.core import tasks
from finetune.core.config.grpo import GRPOObjective
from finetune.core.errors import RewardError
from finetune.core.rewards import Reward, resolve


def _trainer(tiny_model_cfg: Any, out: Path, extra: list[Reward], max_steps: int = 2) -> Any:
    from datasets import Dataset
    from peft import LoraConfig

    from finetune.modeling import tiny
    from finetune.train.grpo_trainer import build_grpo_config, build_grpo_trainer, prompt_rows

    torch.manual_seed(0)
    tokenizer = tiny.load_tokenizer(tiny_model_cfg)
    model = tiny.load_model(tiny_model_cfg, dtype=torch.bfloat16)
    dataset = Dataset.from_list(prompt_rows(tasks.generate(16, 0)))
    grpo = GRPOObjective(rewards=["exact_match"], num_generations=4, max_completion_length=6)
    rewards = [*resolve(grpo.rewards), *extra]
    args = build_grpo_config(
        grpo,
        rewards,
        out,
        generation="transformers",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=max_steps,
        learning_rate=5e-3,
        logging_steps=1,
        report_to=[],
        bf16=True,
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return build_grpo_trainer(model, tokenizer, dataset, rewards, args, lora)


def test_grpo_trains_on_our_rewards_bf16_cpu(tiny_cache: Path, tiny_model_cfg: Any, tmp_path: Path) -> None:
    returned: list[list[float]] = []

    def letters(prompts: Any, completions: Any, references: Any) -> list[float]:
        # spread within each group, so the advantages are non-zero even for a random model
        values = [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]
        returned.append(values)
        return values

    trainer = _trainer(tiny_model_cfg, tmp_path / "out", [Reward("letters", 0.5, letters)])
    assert trainer.args.reward_weights == [1.0, 0.5]
    assert not trainer.args.use_vllm
    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    assert base and all(p.dtype == torch.bfloat16 for p in base)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and len(returned) == 2
    for log, values in zip(logs, returned):
        # 4 completions of one prompt per step; TRL's logged mean is the mean of what our reward returned
        assert len(values) == 4
        assert log["rewards/letters/mean"] == pytest.approx(sum(values) / 4, abs=1e-6)
        assert log["reward"] == pytest.approx(
            log["rewards/exact_match/mean"] + 0.5 * sum(values) / 4, abs=1e-6
        )
        assert log["completions/max_length"] <= 6
    assert any(log["reward_std"] > 0 for log in logs)
    moved = [
        n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])
    ]
    assert moved, "no adapter weight changed"
    assert all("lora_" in n for n in moved)


def test_a_reward_that_raises_stops_training_with_one_line(
    tiny_cache: Path, tiny_model_cfg: Any, tmp_path: Path
) -> None:
    def flaky(prompts: Any, completions: Any, references: Any) -> list[float]:
        raise ZeroDivisionError("division by zero")

    trainer = _trainer(tiny_model_cfg, tmp_path / "out", [Reward("my.flaky", 1.0, flaky)], max_steps=1)
    with pytest.raises(RewardError) as err:
        trainer.train()
    assert str(err.value) == "reward 'my.flaky' raised ZeroDivisionError: division by zero"
