"""Length limits, by characters before tokenizing and by tokens after, and `train.seq_len=auto` resolved.

The character bound (`max_chars`) is safe: a sample over it cannot fit in the
token limit, so dropping it early never drops one that would have fit. After
tokenizing, samples outside data.min_tokens and the token limit are dropped (or
cut, data.too_long=truncate), and `seq_len=auto` takes the longest kept sample
(or a percentile of the kept lengths). Every kept sample has a label to learn
within its kept tokens, and each split asked for keeps at least one sample.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from finetune.core.config import Config
from finetune.core.errors import DataError
from finetune.data import stats
from finetune.data.tokens import Tokens


def hard_limit(cfg: Config) -> int:
    """Tokens a sample may hold before `train.seq_len=auto` is resolved: the sequence length or the
    model's context, capped by data.max_tokens."""
    seq_len_cfg = cfg.train.seq_len
    hard = cfg.model.max_position_embeddings if seq_len_cfg == "auto" else int(seq_len_cfg)
    if cfg.data.max_tokens:
        hard = min(hard, cfg.data.max_tokens)
    return hard


def max_chars(tokenizer: Any, max_tokens: int) -> int:
    """Characters of content beyond which a sample cannot fit in `max_tokens` tokens, so it is dropped (or
    cut, with data.too_long=truncate) before it costs any rendering or tokenizing.

    A token covers at most as many characters of text as its vocabulary string is long (byte-level
    BPE: a byte per vocabulary character; SentencePiece: a character each, byte fallback tokens are
    longer), so `max_tokens` tokens never hold more than `max_tokens` x the longest vocabulary entry;
    doubled where the tokenizer normalizes first (NFKC can compose two characters into one).
    """
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None
    return max_tokens * max(longest, 1) * (2 if normalizes else 1)


@dataclass
class Rows:
    """After the length limits: every sample's length, the sequence length, and the samples kept per split."""

    lengths: Any
    seq_len: int
    truncated: int
    empty_masks: int
    train: Any  # indices into the samples of `Tokens`
    evals: Any


def apply(tokens: Tokens, cfg: Config, hard: int, dropped: Counter) -> Rows:
    """Length limits, then train.seq_len=auto (the longest kept sample, or a percentile with truncation);
    what they drop is counted in `dropped`."""
    import numpy as np

    dc, seq_len_cfg, full_lengths = cfg.data, cfg.train.seq_len, tokens.full_lengths
    keep = full_lengths >= dc.min_tokens
    dropped["too_short"] += int((~keep).sum())
    over = keep & (full_lengths > hard)
    if dc.too_long == "drop":
        dropped["too_long"] += int(over.sum())
        keep &= ~over
    lengths = np.minimum(full_lengths, hard)
    truncated = int((keep & over).sum())
    if not keep.any():
        raise DataError(f"no samples left after the length limits ({dict(dropped)})")
    seq_len = (
        stats.percentile(np.sort(lengths[keep]).tolist(), dc.seq_len_percentile)
        if seq_len_cfg == "auto"
        else int(seq_len_cfg)
    )
    truncated += int((keep & (lengths > seq_len)).sum())  # only with auto below the 100th percentile
    lengths = np.minimum(lengths, seq_len)
    empty = keep & (tokens.trainable(lengths) == 0)
    empty_masks = int(empty.sum())
    if empty_masks == int(keep.sum()):
        raise DataError(
            f"every sample has an empty label mask after the length limits (seq_len {seq_len}, "
            f"data.train_on={dc.train_on}): training would see zero loss; raise train.seq_len or data.max_tokens"
        )
    dropped["no_trainable_tokens"] += empty_masks
    keep &= ~empty
    n_train = tokens.num_train
    train_rows = np.flatnonzero(keep[:n_train])
    eval_rows = n_train + np.flatnonzero(keep[n_train:])
    if not len(train_rows):
        raise DataError(f"no training samples left after cleaning ({dict(dropped)})")
    if len(tokens.full_lengths) > n_train and not len(eval_rows):
        # A held-out split was asked for and the limits emptied it: evaluation would report a NaN loss.
        raise DataError(
            f"no held-out samples left after the length limits (seq_len {seq_len}, all "
            f"{len(tokens.full_lengths) - n_train} dropped): raise train.seq_len, or set data.eval_fraction=0"
        )
    return Rows(lengths, seq_len, truncated, empty_masks, train_rows, eval_rows)
