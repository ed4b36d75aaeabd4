"""Preference metrics on held-out pairs: is the chosen answer the more likely one, by the implicit reward?

DPO's implicit reward of an answer is beta x (log pi(answer | prompt) - log pi_ref(answer | prompt)), the
reference being the model training started from (the base, or `init_from`'s model). On the held-out pairs:

- `preference_accuracy`: the fraction of pairs whose chosen answer has the higher implicit reward (TRL's
  `rewards/accuracies`; a tie, as every pair of the reference against itself, counts as not preferred);
- `reward_margin`: the mean of the chosen reward minus the rejected one (TRL's `rewards/margins`);
- `logprob_accuracy`: the fraction whose chosen answer is more likely under the model itself, with no
  reference: what the base already prefers, so base and trained compare on one scale.

Every model is scored against the same reference log-probabilities, computed once from the reference
model (`log_probs` of it), so base, trained and merged compare like with like.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from trl.trainer.dpo_trainer import DataCollatorForPreference

from finetune.modeling.variants import load_variant

# Pairs per forward: both sides of each go through the model together (twice the rows).
BATCH_PAIRS = 8


@torch.no_grad()
def log_probs(
    model: Any, dataset: Any, pad_token_id: int, batch_pairs: int = BATCH_PAIRS
) -> list[list[float]]:
    """[chosen, rejected] summed log-probabilities of each pair's answer tokens given its prompt.

    The logits of one small batch at a time (log-softmax at the answer positions only): evaluation
    holds no optimizer state or activations, and a batch of 16 sequences is the measure of its peak."""
    collate = DataCollatorForPreference(pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    try:
        for start in range(0, len(dataset), batch_pairs):
            rows = [
                {k: dataset[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                for i in range(start, min(start + batch_pairs, len(dataset)))
            ]
            batch = collate(rows)
            ids = batch["input_ids"].to(device)
            logits = model(
                input_ids=ids, attention_mask=batch["attention_mask"].to(device), use_cache=False
            ).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            mask = batch["completion_mask"][:, 1:].to(device)
            sums = (token_logp * mask).sum(dim=1).tolist()
            n = len(rows)
            out.extend([sums[i], sums[n + i]] for i in range(n))
    finally:
        model.train(was_training)
    return out


def applies(eval_dataset: Any) -> bool:
    """The held-out split holds preference pairs (the data stage's `preferences` record kind)."""
    return eval_dataset is not None and "chosen_ids" in eval_dataset.column_names


def scores(policy: list[list[float]], reference: list[list[float]], beta: float) -> dict[str, float]:
    """preference_accuracy, reward_margin, logprob_accuracy and the mean rewards, over the held-out pairs."""
    if not policy:
        return {}
    n = len(policy)
    chosen = [beta * (p[0] - r[0]) for p, r in zip(policy, reference)]
    rejected = [beta * (p[1] - r[1]) for p, r in zip(policy, reference)]
    return {
        "preference_accuracy": sum(c > r for c, r in zip(chosen, rejected)) / n,
        "reward_margin": sum(c - r for c, r in zip(chosen, rejected)) / n,
        "reward_chosen": sum(chosen) / n,
        "reward_rejected": sum(rejected) / n,
        "logprob_accuracy": sum(p[0] > p[1] for p in policy) / n,
        "pairs": n,
    }


class ReferenceScorer:
    """An objective's scores against one reference: the base's log-probabilities of the held-out rows, from the
    base as scored in this evaluation, or loaded once when the base is not among the models scored. A subclass
    says which held-out rows it scores (`rows_apply`), their log-probabilities (`row_log_probs`) and the scores
    of a model's against the reference's (`compare`)."""

    def rows_apply(self, eval_dataset: Any) -> bool:
        return applies(eval_dataset)

    def row_log_probs(self, model: Any, dataset: Any, pad_token_id: int) -> list[Any]:
        return log_probs(model, dataset, pad_token_id)

    def __init__(self, cfg: Any, run_dir: Path, eval_dataset: Any, tokenizer: Any, variants: Sequence[str]):
        self.beta = cfg.objective.beta
        self.dataset = eval_dataset if self.rows_apply(eval_dataset) else None
        self.pad_token_id = tokenizer.pad_token_id
        self.reference: Optional[list[Any]] = None
        if self.dataset is not None and "base" not in variants:
            model = load_variant(cfg, run_dir, "base")
            try:
                self.reference = self.row_log_probs(model, self.dataset, self.pad_token_id)
            finally:
                del model
                gc.collect()

    def score(
        self, model: Any, variant: str, items: Sequence[dict], answers: Sequence[str]
    ) -> dict[str, float]:
        if self.dataset is None:
            return {}
        mine = self.row_log_probs(model, self.dataset, self.pad_token_id)
        if self.reference is None:  # the base, scored first: the reference of the models after it
            self.reference = mine
        return self.compare(mine, self.reference)

    def compare(self, mine: list[Any], reference: list[Any]) -> dict[str, float]:
        return scores(mine, reference, self.beta)


class Scorer(ReferenceScorer):
    """The `preference` scores: DPO's implicit rewards of each held-out pair's two answers."""
