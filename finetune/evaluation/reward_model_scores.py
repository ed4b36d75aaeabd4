"""The `reward_model` scores: a reward model's own judgement of the held-out pairs, base (the untrained score
head) against trained, so the report says whether training taught it to rank.

Each held-out pair's prompt + chosen and prompt + rejected sequences go through the sequence classifier
together, batched as training batched them; a sequence's score is the one value the head gives it (read at its
last token). Over the pairs:

- `pair_accuracy`: the fraction whose chosen sequence scores strictly above the rejected one (TRL's
  `accuracy`; a tie counts as not ranked);
- `score_margin`: the mean of the chosen score minus the rejected one (TRL's `margin`);
- `score_chosen`, `score_rejected`: the mean score of each side.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.modeling.reward_model import pair_scores


def applies(eval_dataset: Any) -> bool:
    """The held-out split holds preference pairs (the data stage's `preferences` record kind)."""
    return eval_dataset is not None and "chosen_ids" in eval_dataset.column_names


def scores(pairs: Sequence[Sequence[float]]) -> dict[str, float]:
    """pair_accuracy, score_margin and the mean score of each side, over the held-out pairs' [chosen, rejected]."""
    if not pairs:
        return {}
    n = len(pairs)
    return {
        "pair_accuracy": sum(c > r for c, r in pairs) / n,
        "score_margin": sum(c - r for c, r in pairs) / n,
        "score_chosen": sum(c for c, _ in pairs) / n,
        "score_rejected": sum(r for _, r in pairs) / n,
        "pairs": n,
    }


class Scorer:
    """Each model's `reward_model` scores on the held-out pairs."""

    def __init__(self, cfg: Any, run_dir: Path, eval_dataset: Any, tokenizer: Any, variants: Sequence[str]):
        self.dataset = eval_dataset if applies(eval_dataset) else None
        self.pad_token_id = tokenizer.pad_token_id

    def score(
        self, model: Any, variant: str, items: Sequence[dict], answers: Sequence[str]
    ) -> dict[str, float]:
        if self.dataset is None:
            return {}
        return scores(pair_scores(model, self.dataset, self.pad_token_id))
