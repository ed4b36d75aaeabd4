"""Batches of pre-tokenized rows: packed training rows and one-conversation eval rows alike.

Rows carry `input_ids` and `labels` (-100 where no loss), packed rows also
`position_ids` restarting at every sample. The batch is right-padded and
carries `position_ids` but no attention mask: transformers then builds a
block-diagonal causal mask from the position ids (SDPA, eager) or runs the
variable-length kernel (FlashAttention), so packed samples never attend to one
another. Padding forms a segment of its own and has no labels; a label at a
sample's first position is dropped too (it would be predicted from the
previous sample).

`flatten=True` (for `train.attention=flash`) concatenates the micro-batch into
one row instead: transformers runs flash-attn's variable-length kernel only for
a batch of one row, and the row has no padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100
# Popped by the trainer before the forward: real (non-padding) tokens in the batch, for tokens/s.
NUM_TOKENS_KEY = "num_tokens"


# Ours, not TRL's or transformers' collators (scripts/bench_library_parts.py, BENCHMARKS.md): TRL's padded mode lets
# packed samples attend to each other; its padding_free mode and DataCollatorWithFlattening flatten the micro-batch
# into one row, so SDPA masks and attends (micro x seq)^2, 4x ours at 4 rows of 8k (`flatten` does that for flash).
@dataclass
class PackedCollator:
    pad_token_id: int
    pad_to_multiple_of: int = 1
    flatten: bool = False

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if self.flatten and len(rows) > 1:
            rows = [_concatenate(rows)]
        lengths = [len(r["input_ids"]) for r in rows]
        width = max(lengths)
        if self.pad_to_multiple_of > 1:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            input_ids[i, :n] = torch.as_tensor(row["input_ids"])
            labels[i, :n] = torch.as_tensor(row["labels"])
            pos = row.get("position_ids")
            position_ids[i, :n] = torch.as_tensor(pos) if pos is not None else torch.arange(n)
            position_ids[i, n:] = torch.arange(width - n)
        labels[position_ids == 0] = IGNORE_INDEX
        return {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            # A plain int: a sequence split's loader (deepspeed's UlyssesSPDataLoaderAdapter) cuts every tensor
            # along the sequence and copies other values to each shard.
            NUM_TOKENS_KEY: sum(lengths),
        }


def _concatenate(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The rows end to end as one row, each keeping its position ids (restarting at every sample)."""
    joined: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        n = len(row["input_ids"])
        pos = row.get("position_ids")
        joined["input_ids"].extend(int(x) for x in row["input_ids"])
        joined["labels"].extend(int(x) for x in row["labels"])
        joined["position_ids"].extend(range(n) if pos is None else (int(x) for x in pos))
    return joined
