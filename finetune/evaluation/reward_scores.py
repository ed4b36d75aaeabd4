"""The `rewards` scores: the objective's own rewards (its settings' `rewards`) on each model's generated
answers to the held-out prompts, so the report says whether the policy earns more of what it was trained
to earn (`mean_reward`, `pass_rate`: finetune/core/rewards.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.core import rewards


class Scorer:
    """Each model's answers scored with the run's rewards, resolved once."""

    def __init__(self, cfg: Any, run_dir: Path, eval_dataset: Any, tokenizer: Any, variants: Sequence[str]):
        self.rewards = rewards.for_objective(cfg)

    def score(
        self, model: Any, variant: str, items: Sequence[dict], answers: Sequence[str]
    ) -> dict[str, float]:
        if not self.rewards or not items:
            return {}
        refs = [it["reference"] for it in items]
        return rewards.scores(self.rewards, [it["prompt"] for it in items], list(answers), refs)
