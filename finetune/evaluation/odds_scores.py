"""The reference-free preference scores of held-out pairs, each read as its objective's loss reads a pair.

No reference model: every model is scored on its own log-probabilities of each pair's two answers given the
prompt (`preference.log_probs`: summed over the answer tokens; divided by the answer's length for a mean).

- ORPO (`OddsRatioScorer`): the odds of an answer are p / (1 - p), p its mean per-token probability; the log
  odds ratio is log odds(chosen) - log odds(rejected). `odds_ratio_accuracy`: the fraction of pairs where it is
  above 0 (TRL's `rewards/accuracies`); `log_odds_ratio`: its mean (what ORPO's loss pushes up);
  `chosen_logprob`: the chosen answer's mean per-token log-probability (what its NLL term pushes up).
- CPO and SimPO (`MarginScorer`): the reward of an answer is beta x its log-probability (its mean per token
  where the settings' `length_normalised` says, SimPO's), and the margin is chosen's minus rejected's.
  `margin_accuracy`: the fraction of pairs with a margin above 0; `reward_margin`: its mean; `margin_met`: the
  fraction above the settings' `target_margin` (SimPO's gamma; 0 for CPO).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.evaluation.preference import applies, log_probs


def log_odds(mean_logprob: float) -> float:
    """log(p / (1 - p)) of p = exp(mean_logprob), stable near p = 1 and p = 0 (TRL's log1mexp)."""
    x = min(mean_logprob, -1e-12)
    log1m = math.log1p(-math.exp(x)) if x < -math.log(2) else math.log(-math.expm1(x))
    return x - log1m


class _PairScorer:
    """Each model's summed log-probabilities of each held-out pair's answers, and the answers' lengths."""

    def __init__(self, cfg: Any, run_dir: Path, eval_dataset: Any, tokenizer: Any, variants: Sequence[str]):
        self.settings = cfg.objective
        self.dataset = eval_dataset if applies(eval_dataset) else None
        self.pad_token_id = tokenizer.pad_token_id
        self.lengths: list[tuple[int, int]] = []
        if self.dataset is not None:
            rows = self.dataset.select_columns(["chosen_ids", "rejected_ids"])
            self.lengths = [(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows]

    def score(
        self, model: Any, variant: str, items: Sequence[dict], answers: Sequence[str]
    ) -> dict[str, float]:
        if self.dataset is None or not self.lengths:
            return {}
        sums = log_probs(model, self.dataset, self.pad_token_id)
        return self.scores(sums)

    def means(self, sums: list[list[float]]) -> list[tuple[float, float]]:
        """Each pair's (chosen, rejected) mean per-token log-probability."""
        return [(c / max(lc, 1), r / max(lr, 1)) for (c, r), (lc, lr) in zip(sums, self.lengths)]

    def scores(self, sums: list[list[float]]) -> dict[str, float]:
        raise NotImplementedError


class OddsRatioScorer(_PairScorer):
    """ORPO's `odds_ratio` scores of each model."""

    def scores(self, sums: list[list[float]]) -> dict[str, float]:
        means = self.means(sums)
        ratios = [log_odds(c) - log_odds(r) for c, r in means]
        n = len(ratios)
        return {
            "odds_ratio_accuracy": sum(x > 0 for x in ratios) / n,
            "log_odds_ratio": sum(ratios) / n,
            "chosen_logprob": sum(c for c, _ in means) / n,
            "pairs": n,
        }


class MarginScorer(_PairScorer):
    """CPO's and SimPO's `logprob_margin` scores of each model, with the settings' beta and target margin."""

    def scores(self, sums: list[list[float]]) -> dict[str, float]:
        s = self.settings
        pairs = self.means(sums) if s.length_normalised else [(c, r) for c, r in sums]
        margins = [s.beta * (c - r) for c, r in pairs]
        n = len(margins)
        return {
            "margin_accuracy": sum(m > 0 for m in margins) / n,
            "reward_margin": sum(margins) / n,
            "margin_met": sum(m > s.target_margin for m in margins) / n,
            "pairs": n,
        }
