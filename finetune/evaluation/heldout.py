"""Held-out evaluation: token-level loss and greedy-generation exact match on the eval split.

The same function scores the base model (before training) and the trained one,
so `metrics.json` compares like with like: the loss is the mean over every
labelled token of the split (computed with the chunked loss, so no full logits),
and the task metric comes from `finetune.core.tasks.score` on greedy answers to the
held-out prompts rendered with the same chat template.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any, Optional

import torch

from finetune.core import tasks
from finetune.core.config.evaluation import EvalConfig
from finetune.evaluation import rewards
from finetune.evaluation.generate import generate
from finetune.modeling.chunked_loss import add_chunked_loss_head
from finetune.modeling.collator import NUM_TOKENS_KEY, PackedCollator

# Generated answers stop at the end-of-turn token or after this many tokens beyond the longest reference.
EXTRA_NEW_TOKENS = 4


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


def evaluate(
    model: Any,
    tokenizer: Any,
    eval_dataset: Any,
    *,
    max_generate: Optional[int] = 256,
    batch_size: int = 16,
    examples: int = 0,
    reward_fns: Optional[Sequence[rewards.Reward]] = None,
) -> dict[str, Any]:
    """{"loss", "exact_match", per-task exact match...} on the held-out split (model left in train mode after);
    with `reward_fns` (the objective's rewards) also `mean_reward` and `pass_rate` of the same answers."""
    was_training = model.training
    model.eval()
    try:
        loss = heldout_loss(model, eval_dataset, tokenizer.pad_token_id, batch_size)
        result: dict[str, Any] = {} if loss is None else {"loss": loss}
        n = len(eval_dataset) if max_generate is None else min(max_generate, len(eval_dataset))
        pairs: list[tuple[list[dict], str]] = []
        # eval.num_samples=0: the loss alone, no answers generated
        if "messages" in eval_dataset.column_names and n:
            pairs = [(conversation, reference) for _, conversation, reference in answered(eval_dataset, n)]
            n = len(pairs)
        if pairs:
            prompts = [p for p, _ in pairs]
            references = [r for _, r in pairs]
            longest = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in references)
            # greedy, left-padded, one rendered prompt each: the evaluation stage's generation
            settings = EvalConfig(
                max_new_tokens=longest + EXTRA_NEW_TOKENS,
                batch_size=batch_size * 2,
                greedy=True,
                progress=False,
            )
            predictions = generate(model, tokenizer, prompts, settings)
            last_user = [
                next((m["content"] for m in reversed(p) if m["role"] == "user"), "") for p in prompts
            ]
            result.update(tasks.score(last_user, predictions, references))
            if reward_fns:
                result.update(rewards.scores(reward_fns, last_user, predictions, references))
            result["generated"] = n
            if examples:
                result["examples"] = [
                    {"prompt": u, "reference": r, "prediction": p}
                    for u, r, p in list(zip(last_user, references, predictions))[:examples]
                ]
    finally:
        model.train(was_training)
    return result
