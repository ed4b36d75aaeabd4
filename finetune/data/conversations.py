"""The `conversations` record kind (SFT): messages with assistant turns to learn, tokenized with masked labels
and packed into rows (`rows.save_packed` writes them)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.data import limits, pack, samples, sources, stats
from finetune.data import rows as saved_rows
from finetune.data.limits import Rows
from finetune.data.prepare import TextLimits, streamed
from finetune.data.render import Renderer
from finetune.data.tokens import BATCH, Tokens, check_labels, tokenize


@dataclass
class Prepared:
    """Conversations prepared for SFT, not yet saved: the rows kept and how the training rows pack."""

    stats: dict  # data_stats.json's content
    tokens: Tokens
    rows: Rows
    bins: list[list[int]]  # training rows packed: each bin lists positions in `rows.train`, longest bin first
    eval_messages: list[str]  # the conversation of each eval row (JSON text), for generation from its prompt


def prepare(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> Prepared:
    """Conversation records prepared for SFT: cleaned, split, tokenized with masked labels, limited, packed;
    what the pass holds per sample beyond a fixed size goes to files under `scratch` (removed when done)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    loaded = sources.Loaded()
    text = TextLimits.of(cfg, tokenizer, dc.train_on)
    with streamed(inp, loaded, dc, text, path, tally, scratch, console) as part:
        tokens = tokenize(
            _batches(part.kept.store, part.train_rows, part.eval_rows, part.bar),
            len(part.train_rows),
            text.renderer,
            dc.num_proc,
            part.scratch,
        )
        check_labels(tokens, dc.train_on)
        rows = limits.apply(tokens, cfg, text.hard, tally.dropped)
        eval_messages = part.kept.store.texts(part.eval_rows[rows.evals - tokens.num_train])
    bins = _bins(rows, dc)
    result = _stats(cfg, loaded, path, tally, text.char_limit, text.renderer, tokens, rows, bins)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return Prepared(result, tokens, rows, bins, eval_messages)


def _batches(store: samples.TextStore, train_rows: Any, eval_rows: Any, bar: Any) -> Iterator[list[str]]:
    """The texts of the training rows, then the eval rows, `tokens.BATCH` at a time, with a progress task."""
    task = bar.add_task("render+tokenize", total=len(train_rows) + len(eval_rows))
    for rows in (train_rows, eval_rows):
        for i in range(0, len(rows), BATCH):
            batch = store.texts(rows[i : i + BATCH])
            yield batch
            bar.advance(task, len(batch))


def _bins(rows: Rows, dc: DataConfig) -> list[list[int]]:
    """Training rows packed into bins (best fit decreasing, longest first; data.packing=false: one a bin)."""
    train_lengths = rows.lengths[rows.train].tolist()
    if dc.packing:
        bins = pack.best_fit_decreasing(train_lengths, rows.seq_len)
    else:
        bins = [[i] for i in range(len(rows.train))]
    return pack.order_bins(bins, train_lengths, dc.seed)


def _stats(
    cfg: Config,
    loaded: sources.Loaded,
    path: str,
    tally: samples.Tally,
    char_limit: int,
    renderer: Renderer,
    tokens: Tokens,
    rows: Rows,
    bins: list[list[int]],
) -> dict:
    """data_stats.json's content (less the cache, the input fingerprint and the seconds, filled in later)."""
    dc, seq_len = cfg.data, rows.seq_len
    train_lengths = rows.lengths[rows.train].tolist()
    return {
        "num_input": tally.num_input,
        "formats": dict(sorted(loaded.formats.items())),
        "num_train": len(rows.train),
        "num_eval": len(rows.evals),
        "dropped": {k: v for k, v in sorted(tally.dropped.items()) if v},
        "truncated": rows.truncated,
        "max_chars": char_limit,
        "control_tokens": {"mode": dc.control_tokens, "samples": tally.with_control},
        "pii": dict(sorted(tally.pii.items())),
        "skipped_files": loaded.empty_files,
        "bad_input_examples": list(sources.iter_where(loaded)),
        **_token_stats(tokens, rows),
        "empty_masks": rows.empty_masks,
        "masks": {
            "train_on": dc.train_on,
            "method": "generation_markers"
            if renderer.markers or dc.train_on == "all"
            else "prefix_rendering",
            "search_fallbacks": renderer.prefix_fallbacks,
        },
        "packing": {
            "enabled": dc.packing,
            "bins": len(bins),
            "efficiency": round(pack.efficiency(train_lengths, bins, seq_len), 6),
            "seq_len": seq_len,
            "longest_first": True,
        },
        "seq_len": seq_len,
        "seq_len_source": (
            f"auto: p{dc.seq_len_percentile:g} of kept lengths"
            if cfg.train.seq_len == "auto"
            else "train.seq_len"
        ),
        "input": {"path": path, "fingerprint": None},
        "seconds": None,
    }


def _token_stats(tokens: Tokens, rows: Rows) -> dict:
    """data_stats.json's `tokens`, `splits` and `trainable_tokens`: lengths after the limits, by split."""
    train_lengths = rows.lengths[rows.train].tolist()
    eval_lengths = rows.lengths[rows.evals].tolist()
    overall = stats.summary(train_lengths + eval_lengths)
    trainable = tokens.trainable(rows.lengths)
    return {
        "tokens": {
            "train_total": sum(train_lengths),
            "eval_total": sum(eval_lengths),
            **{k: overall[k] for k in ("min", "p50", "p95", "p99", "max")},
        },
        "splits": {"train": stats.summary(train_lengths), "eval": stats.summary(eval_lengths)},
        "trainable_tokens": {
            "train": int(trainable[rows.train].sum()),
            "eval": int(trainable[rows.evals].sum()),
        },
    }


def save(prepared: Prepared, out: Path) -> None:
    """The packed training rows, the eval rows and the histogram into the folder `out` (a cache entry being built)."""
    with saved_rows.quiet_datasets():
        saved_rows.save_packed(prepared.tokens, prepared.rows, prepared.bins, prepared.eval_messages, out)
