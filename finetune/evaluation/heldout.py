"""The held-out loss, and the held-out conversations split into prompt and reference answer.

The eval stage scores base, trained and merged models with the same function, so `eval/metrics.json`
compares like with like: the mean next-token loss over every labelled token of the split, computed with
the chunked loss (no full logits).
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Optional

import torch

from finetune.modeling.chunked_loss import add_chunked_loss_head
from finetune.modeling.collator import NUM_TOKENS_KEY, PackedCollator
from finetune.modeling.vision import VisionCollator


@torch.no_grad()
def heldout_loss(model: Any, dataset: Any, pad_token_id: int, batch_size: int = 16) -> Optional[float]:
    """Mean next-token loss over all labelled tokens of `dataset` (rows with input_ids and labels); None when
    there is none (data.eval_fraction=0): no loss, rather than a NaN in metrics.json."""
    # preference pairs (scored by `preference`) and GRPO's prompts: no labelled tokens to score a loss on
    if "labels" not in dataset.column_names:
        return None
    collate = PackedCollator(pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    add_chunked_loss_head(model)
    total, count = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batch = collate(rows)
        batch.pop(NUM_TOKENS_KEY)
        labels = batch.pop("labels").to(device)
        n = int((labels[:, 1:] != -100).sum())
        if n == 0:
            continue
        # The summed loss (num_items_in_batch=1), no logits: the trainer's loss path, which casts the
        # hidden states to the head's dtype (after training, accelerate's wrapper hands back fp32 ones).
        out = model(
            **{k: v.to(device) for k, v in batch.items()},
            labels=labels,
            chunked_loss=True,
            num_items_in_batch=1,
            use_cache=False,
        )
        total += float(out.loss)
        count += n
    return total / count if count else None


@torch.no_grad()
def vision_heldout_loss(model: Any, dataset: Any, processor: Any, batch_size: int = 16) -> Optional[float]:
    """`heldout_loss` for a vision-language model's rows (one conversation and its images each), batched by its
    processor as in training (`VisionCollator`): the mean loss over every labelled token, the model's own loss."""
    collate = VisionCollator(processor)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        batch.pop(NUM_TOKENS_KEY)
        n = int((batch["labels"][:, 1:] != -100).sum())
        if n == 0:
            continue
        inputs = {
            k: v.to(device, model.dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()
        }
        total += float(model(**inputs, use_cache=False).loss) * n  # the model's mean over its labelled tokens
        count += n
    return total / count if count else None


def split_prompt(messages: list[dict]) -> tuple[list[dict], str]:
    """The conversation up to its last assistant turn, and that turn's content (the reference answer)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return messages[:i], messages[i]["content"]
    raise ValueError("conversation has no assistant turn")


def answered(eval_dataset: Any, limit: int) -> list[tuple[int, list[dict], str]]:
    """The first `limit` held-out rows that end in an answer: (row, the conversation up to it, the answer).
    Plain-text rows (data.format=text) hold no answer to generate: their loss alone measures them."""
    rows = ((i, json.loads(eval_dataset[i]["messages"])) for i in range(len(eval_dataset)))
    with_answer = ((i, m) for i, m in rows if any(x["role"] == "assistant" for x in m))
    return [(i, *split_prompt(m)) for i, m in itertools.islice(with_answer, limit)]
