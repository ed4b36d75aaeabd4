"""The `rewards` scores: the objective's own rewards (its settings' `rewards`) on each model's generated
answers to the held-out prompts, so the report says whether the policy earns more of what it was trained
to earn (`mean_reward`, `pass_rate`: finetune/core/rewards.py), and the learned reward model's mean score of
them when the settings name one (`reward_model_score`; `mean_reward` then adds it at its weight, the sum
GRPO ranks by)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from trl.data_utils import apply_chat_template

from finetune.core import rewards
from finetune.modeling import reward_model
from finetune.modeling.dtypes import eval_dtype
from finetune.modeling.variants import device_map


class Scorer:
    """Each model's answers scored with the run's rewards (and its reward model), resolved and loaded once."""

    def __init__(self, cfg: Any, run_dir: Path, eval_dataset: Any, tokenizer: Any, variants: Sequence[str]):
        self.rewards = rewards.for_objective(cfg)
        self.learned: Optional[tuple[Any, Any]] = None
        path = getattr(cfg.objective, "reward_model", None)
        if path:
            self.learned = reward_model.load(path, cfg.model, eval_dtype(cfg), device_map(cfg))
            self.weight = float(cfg.objective.reward_model_weight)

    def score(
        self, model: Any, variant: str, items: Sequence[dict], answers: Sequence[str]
    ) -> dict[str, float]:
        if not items or not (self.rewards or self.learned):
            return {}
        out: dict[str, float] = {}
        if self.rewards:
            refs = [it["reference"] for it in items]
            out.update(rewards.scores(self.rewards, [it["prompt"] for it in items], list(answers), refs))
        if self.learned is not None:
            learned = self.learned_scores(items, answers)
            out["reward_model_score"] = sum(learned) / len(learned)
            out["mean_reward"] = out.get("mean_reward", 0.0) + self.weight * out["reward_model_score"]
        return out

    def learned_scores(self, items: Sequence[dict], answers: Sequence[str]) -> list[float]:
        """The reward model's score of each prompt + answer, rendered as GRPO's trainer renders a completion."""
        assert self.learned is not None
        model, tokenizer = self.learned
        texts = [
            apply_chat_template(
                {"messages": list(it["messages"]) + [{"role": "assistant", "content": answer}]}, tokenizer
            )["text"]
            for it, answer in zip(items, answers)
        ]
        return reward_model.text_scores(model, tokenizer, texts)
