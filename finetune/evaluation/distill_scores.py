"""Distillation metrics on the held-out conversations: how closely each model's next-token distributions follow
the teacher's at the assistant tokens (the positions the training loss covers).

- `teacher_top1_agreement`: the fraction of those positions where the model's most likely token is the
  teacher's;
- `teacher_kl`: the mean KL(teacher || model) per position, in nats, at temperature 1 (the distributions as
  they are, whatever `objective.temperature` trained with).

The teacher is the settings' (`objective.teacher`), loaded once per evaluation in the evaluation dtype; base,
trained and merged are each compared with it on the same rows. The task metric of the conversations is the
evaluation's own (every objective's generation metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from finetune.modeling import companions
from finetune.modeling.collator import IGNORE_INDEX, NUM_TOKENS_KEY, PackedCollator
from finetune.modeling.dtypes import eval_dtype

# Held-out rows per forward (each model and the teacher hold one batch's logits at a time).
BATCH_ROWS = 8


@torch.no_grad()
def agreement(
    model: Any, teacher: Any, dataset: Any, pad_token_id: int, batch_rows: int = BATCH_ROWS
) -> dict[str, float]:
    """Top-1 agreement and mean KL(teacher || model) over the labelled next-token positions of `dataset`."""
    collate = PackedCollator(pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    agree, kl, positions = 0, 0.0, 0
    try:
        for start in range(0, len(dataset), batch_rows):
            batch = collate([dataset[i] for i in range(start, min(start + batch_rows, len(dataset)))])
            batch.pop(NUM_TOKENS_KEY)
            labels = batch.pop("labels")[:, 1:].to(device)
            mask = labels != IGNORE_INDEX
            if not mask.any():
                continue
            rows = {k: v.to(device) for k, v in batch.items()}
            mine = model(**rows, use_cache=False).logits[:, :-1][mask].float()
            theirs = teacher(**rows, use_cache=False).logits[:, :-1][mask].float().to(device)
            agree += int((mine.argmax(-1) == theirs.argmax(-1)).sum())
            log_t, log_m = torch.log_softmax(theirs, -1), torch.log_softmax(mine, -1)
            kl += float((log_t.exp() * (log_t - log_m)).sum())
            positions += int(mask.sum())
    finally:
        model.train(was_training)
    if not positions:
        return {}
    return {"teacher_top1_agreement": agree / positions, "teacher_kl": kl / positions}


def applies(eval_dataset: Any) -> bool:
    """The held-out split holds tokenized conversations with labelled (assistant) tokens."""
    return eval_dataset is not None and len(eval_dataset) > 0 and "labels" in eval_dataset.column_names


class Scorer:
    """The `distill` scores of each model against the settings' teacher, loaded once."""

    def __init__(self, cfg: Any, run_dir: Path, eval_dataset: Any, tokenizer: Any, variants: Sequence[str]):
        self.dataset = eval_dataset if applies(eval_dataset) else None
        self.pad_token_id = tokenizer.pad_token_id
        self.teacher: Optional[Any] = None
        if self.dataset is not None:
            (resolved,) = companions.resolve_all(cfg)
            self.teacher = companions.load_frozen(cfg, resolved, eval_dtype(cfg))

    def score(
        self, model: Any, variant: str, items: Sequence[dict], answers: Sequence[str]
    ) -> dict[str, float]:
        if self.dataset is None or self.teacher is None:
            return {}
        self.teacher.to(next(model.parameters()).device)
        return agreement(model, self.teacher, self.dataset, self.pad_token_id)
