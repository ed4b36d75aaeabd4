"""Conversations to tokens: rendered with the chat template, labels masked, tokenized in batches.

From here on a sample is a (start, length) slice of flat numpy arrays, train
samples first, then eval; nothing is held per sample but its start, length and
count of trainable labels. Token ids take 2 bytes a token where the vocabulary
fits in uint16, else 4; the label mask one bit (a label is its token's id or
`IGNORE_INDEX`). The first label of every sample is masked: a sample never
predicts its first token, nor (packed) one from the sample before it.

Batches of texts are tokenized one at a time (or by `num_proc` worker processes,
a few batches in flight), each turned into compact arrays before the next, and
the ids appended to a scratch file read back once at the end: the tokenizer's
and the batch's Python lists exist for one batch only, and no second copy of
all the ids is made while joining them.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from finetune.core.errors import DataError
from finetune.data.render import IGNORE_INDEX, Renderer

# Conversations tokenized in one call: the heap a batch leaves is bounded by it.
BATCH = 1024


@dataclass
class Tokens:
    """Every sample rendered, masked and tokenized (train first, then eval): (start, length) slices of a flat
    array of token ids and a bit array of the label mask, with each sample's count of trainable labels."""

    ids: np.ndarray  # uint16 or uint32
    mask_bits: np.ndarray  # np.packbits of the label mask (1: trained on), one bit a token
    starts: np.ndarray  # int64
    full_lengths: np.ndarray  # int32, before any length limit
    trainable_full: np.ndarray  # int32: trainable labels in each whole sample
    num_train: int  # the first `num_train` samples are the training split

    def trainable(self, lengths: Any) -> np.ndarray:
        """Trainable labels in each sample's first `lengths` tokens (counted from the bits where cut)."""
        lengths = np.asarray(lengths)
        out = self.trainable_full.astype(np.int64)
        for i in np.flatnonzero(lengths < self.full_lengths).tolist():
            start = int(self.starts[i])
            out[i] = int(self.mask(np.arange(start, start + int(lengths[i]))).sum())
        return out

    def mask(self, index: np.ndarray) -> np.ndarray:
        """The label mask at token positions `index` (bool)."""
        index = np.asarray(index, dtype=np.int64)
        return ((self.mask_bits[index >> 3] >> (7 - (index & 7)).astype(np.uint8)) & 1).astype(bool)

    def labels(self, index: np.ndarray) -> np.ndarray:
        """The labels at token positions `index`: the token id where trained on, else IGNORE_INDEX (int32)."""
        return np.where(self.mask(index), self.ids[index].astype(np.int32), np.int32(IGNORE_INDEX))


def id_dtype(vocab_size: int) -> Any:
    """uint16 while every id fits, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _encode_batch(texts: list[str], renderer: Renderer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat ids as int64, flat mask, lengths) of a batch of conversations (JSON texts)."""
    input_ids, labels = renderer.encode([json.loads(t) for t in texts])
    lengths = np.fromiter(map(len, input_ids), dtype=np.int32, count=len(input_ids))
    total = int(lengths.sum())
    # chain.from_iterable walks the lists in C, without a generator step a token (2% of the stage's time)
    ids = np.fromiter(chain.from_iterable(input_ids), dtype=np.int64, count=total)
    mask = np.fromiter(chain.from_iterable(labels), dtype=np.int64, count=total) != IGNORE_INDEX
    starts = np.cumsum(lengths, dtype=np.int64) - lengths
    mask[starts[lengths > 0]] = False  # never predict a sample's first token
    return ids, mask, lengths


def _encoded(batches: Iterable[list[str]], renderer: Renderer, num_proc: int) -> Iterator[tuple]:
    """Each batch encoded, in order: here, or by `num_proc` worker processes with 2 batches each in flight
    (a pool's own map reads its whole input ahead; this holds only what is in flight)."""
    if num_proc <= 1:
        for texts in batches:
            yield _encode_batch(texts, renderer)
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(num_proc) as pool:
        pending: deque = deque()
        for texts in batches:
            pending.append(pool.submit(_encode_batch, texts, renderer))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def tokenize(
    batches: Iterable[list[str]], num_train: int, renderer: Renderer, num_proc: int, scratch: Path
) -> Tokens:
    """Render + mask + tokenize batches of conversations (JSON texts; the first `num_train` samples are the
    training split) into compact `Tokens`; the ids pass through `scratch/ids.bin`."""
    dtype = id_dtype(len(renderer.tokenizer))
    limit = np.iinfo(dtype).max
    path = scratch / "ids.bin"
    lengths: list[np.ndarray] = []
    trainable: list[np.ndarray] = []
    bits: list[np.ndarray] = []
    tail = np.zeros(0, dtype=bool)  # mask bits not yet a whole byte
    with path.open("wb") as f:
        for ids, mask, lens in _encoded(batches, renderer, num_proc):
            if len(ids) and int(ids.max()) > limit:
                raise DataError(
                    f"token id {int(ids.max())} beyond the tokenizer's {len(renderer.tokenizer)} entries"
                )
            f.write(ids.astype(dtype).tobytes())
            lengths.append(lens)
            ends = np.cumsum(lens, dtype=np.int64)
            counted = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
            trainable.append((counted[ends] - counted[ends - lens]).astype(np.int32))
            joined = np.concatenate([tail, mask])
            whole = len(joined) // 8 * 8
            bits.append(np.packbits(joined[:whole]))
            tail = joined[whole:]
    bits.append(np.packbits(tail))
    full_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    tokens = Tokens(
        ids=np.fromfile(path, dtype=dtype),
        mask_bits=np.concatenate(bits),
        starts=np.cumsum(full_lengths, dtype=np.int64) - full_lengths,
        full_lengths=full_lengths,
        trainable_full=np.concatenate(trainable) if trainable else np.zeros(0, np.int32),
        num_train=num_train,
    )
    path.unlink()
    return tokens


def check_labels(tokens: Tokens, train_on: str) -> None:
    """Raises when no sample has a label to learn."""
    if not tokens.trainable_full.any():
        raise DataError(
            f"every sample has an empty label mask (data.train_on={train_on}, {len(tokens.full_lengths)} "
            "samples): training would see zero loss; check the chat template and the assistant turns"
        )
