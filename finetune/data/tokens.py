"""Conversations to tokens: rendered with the chat template, labels masked, tokenized in batches.

From here on a sample is a (start, length) slice of flat numpy arrays of token
ids and labels, train samples first, then eval; nothing is copied per sample.
The first label of every sample is masked (`IGNORE_INDEX`): a sample never
predicts its first token, nor (packed) one from the sample before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from finetune.core.errors import DataError
from finetune.data.render import IGNORE_INDEX, Renderer


@dataclass
class Tokens:
    """Every sample rendered, masked and tokenized (train first, then eval): (start, length) slices of flat
    numpy token arrays, with a running count of trainable labels."""

    ids: Any
    labels: Any
    starts: Any
    full_lengths: Any  # before any length limit
    trainable_cum: Any
    num_train: int  # the first `num_train` samples are the training split

    def trainable(self, lengths: Any) -> Any:
        """Trainable labels in each sample's first `lengths` tokens."""
        return self.trainable_cum[self.starts + lengths] - self.trainable_cum[self.starts]


def tokenize(texts: list[str], renderer: Renderer, num_proc: int = 1):
    """Render + mask + tokenize conversations (JSON texts) with `datasets.map` (batched, fast tokenizer,
    `num_proc` workers); int32 token columns, the texts dropped from the result."""
    from datasets import Dataset, Features, Sequence, Value

    ds = Dataset.from_dict({"messages": texts})
    token_list = Sequence(Value("int32"))
    return ds.map(
        _encode_batch,
        batched=True,
        batch_size=256,
        num_proc=num_proc if num_proc > 1 and len(texts) > 1000 else None,
        fn_kwargs={"renderer": renderer},
        remove_columns=["messages"],
        features=Features({"input_ids": token_list, "labels": token_list}),
        keep_in_memory=True,
        load_from_cache_file=False,
        desc="data: render+tokenize",
    )


def _encode_batch(batch: dict, renderer: Renderer) -> dict:
    input_ids, labels = renderer.encode([json.loads(m) for m in batch["messages"]])
    for lab in labels:  # the first token of a sample is never predicted (and never from the previous sample)
        if lab:
            lab[0] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def _running_count(flags: Any) -> Any:
    """[0, flags[0], flags[0] + flags[1], ...]: int32 while it fits (half of int64's memory a token)."""
    import numpy as np

    dtype = np.int32 if len(flags) < np.iinfo(np.int32).max else np.int64
    out = np.zeros(len(flags) + 1, dtype=dtype)
    np.cumsum(flags, dtype=dtype, out=out[1:])
    return out


def tokenize_splits(
    train_convs: list[str], eval_convs: list[str], renderer: Renderer, train_on: str, num_proc: int
) -> Tokens:
    """Both splits tokenized into one `Tokens`; raises when no sample has a label to learn."""
    import numpy as np

    encoded = tokenize(train_convs + eval_convs, renderer, num_proc)
    ids_col = encoded.data.column("input_ids").combine_chunks()
    labels_col = encoded.data.column("labels").combine_chunks()
    offsets = ids_col.offsets.to_numpy().astype(np.int64)
    labels_flat = labels_col.values.to_numpy()
    tokens = Tokens(
        ids=ids_col.values.to_numpy(),
        labels=labels_flat,
        starts=offsets[:-1],
        full_lengths=np.diff(offsets),
        trainable_cum=_running_count(labels_flat != IGNORE_INDEX),
        num_train=len(train_convs),
    )
    if not tokens.trainable(tokens.full_lengths).any():
        raise DataError(
            f"every sample has an empty label mask (data.train_on={train_on}, {len(tokens.full_lengths)} "
            "samples): training would see zero loss; check the chat template and the assistant turns"
        )
    return tokens
