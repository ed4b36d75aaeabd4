"""KTO's scores on held-out labelled examples: are the desirable completions rewarded above the undesirable ones?

An example's implicit reward is beta x (log pi(completion | prompt) - log pi_ref(completion | prompt)), the
reference being the model training started from (the base, or `init_from`'s model), beta the settings'. On the
held-out examples:

- `desirable_margin`: the mean reward of the desirable completions minus that of the undesirable ones (TRL's
  `rewards/margins`, over the whole split);
- `separation_accuracy`: the fraction of (desirable, undesirable) pairs of held-out examples in which the
  desirable one has the higher reward (a tie, as every pair of the reference against itself, is not separated);
- `logprob_separation`: the same with the model's own log-probabilities, no reference: what the base already
  separates, so base and trained compare on one scale;
- `reward_desirable`, `reward_undesirable`: the two means.

Every model is scored against the same reference log-probabilities, computed once from the reference model.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

from finetune.evaluation.preference import ReferenceScorer

# Examples per forward: a batch of 16 sequences, as the preference scores' 8 pairs.
BATCH_EXAMPLES = 16


@torch.no_grad()
def log_probs(model: Any, dataset: Any, pad_token_id: int, batch_size: int = BATCH_EXAMPLES) -> list[float]:
    """Each example's summed log-probability of its completion tokens given its prompt, one small batch at a time
    (log-softmax at the completion positions only)."""
    collate = DataCollatorForUnpairedPreference(pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[float] = []
    try:
        for start in range(0, len(dataset), batch_size):
            rows = [
                {k: dataset[i][k] for k in ("prompt_ids", "completion_ids", "label")}
                for i in range(start, min(start + batch_size, len(dataset)))
            ]
            batch = collate(rows)
            ids = batch["input_ids"].to(device)
            logits = model(
                input_ids=ids, attention_mask=batch["attention_mask"].to(device), use_cache=False
            ).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            mask = batch["completion_mask"][:, 1:].to(device)
            out.extend((token_logp * mask).sum(dim=1).tolist())
    finally:
        model.train(was_training)
    return out


def applies(eval_dataset: Any) -> bool:
    """The held-out split holds labelled examples (the data stage's `labelled` record kind)."""
    return eval_dataset is not None and "completion_ids" in eval_dataset.column_names


def _separation(desirable: list[float], undesirable: list[float]) -> float:
    """The fraction of (desirable, undesirable) pairs ordered with the desirable one strictly above."""
    ranked = sorted(undesirable)
    below = sum(bisect.bisect_left(ranked, d) for d in desirable)
    return below / (len(desirable) * len(undesirable))


def scores(
    policy: Sequence[float], reference: Sequence[float], labels: Sequence[bool], beta: float
) -> dict[str, float]:
    """The KTO scores over the held-out examples; empty unless both labels are present."""
    rewards = [beta * (p - r) for p, r in zip(policy, reference)]
    good = [x for x, label in zip(rewards, labels) if label]
    bad = [x for x, label in zip(rewards, labels) if not label]
    if not good or not bad:
        return {}
    mean_good, mean_bad = sum(good) / len(good), sum(bad) / len(bad)
    return {
        "desirable_margin": mean_good - mean_bad,
        "separation_accuracy": _separation(good, bad),
        "reward_desirable": mean_good,
        "reward_undesirable": mean_bad,
        "logprob_separation": _separation(
            [p for p, label in zip(policy, labels) if label],
            [p for p, label in zip(policy, labels) if not label],
        ),
        "examples": len(rewards),
    }


class Scorer(ReferenceScorer):
    """The `kto` scores of each model against the base's log-probabilities of the held-out completions."""

    def rows_apply(self, eval_dataset: Any) -> bool:
        return applies(eval_dataset)

    def row_log_probs(self, model: Any, dataset: Any, pad_token_id: int) -> list[Any]:
        return log_probs(model, dataset, pad_token_id)

    def __init__(self, cfg: Any, run_dir: Path, eval_dataset: Any, tokenizer: Any, variants: Sequence[str]):
        super().__init__(cfg, run_dir, eval_dataset, tokenizer, variants)
        self.labels = [bool(x) for x in self.dataset["label"]] if self.dataset is not None else []

    def compare(self, mine: list[Any], reference: list[Any]) -> dict[str, float]:
        return scores(mine, reference, self.labels, self.beta)
