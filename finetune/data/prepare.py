"""What a cache miss runs: the input's records in, kept samples, packed bins and data_stats.json's content out.

    read -> messages -> clean -> exact duplicates     (one streamed pass: `samples.collect`)
         -> near duplicates -> split -> tokenize -> length limits -> pack -> stats

Pure of the run directory and the cache: it reads only the input, the
tokenizer and the config, and writes nothing (`rows.save` writes the result),
so the stage's fingerprint of those inputs names the result exactly.

One record kind today: conversations with assistant turns to learn (SFT),
prepared by `conversations` into packed rows. A second kind (preference pairs
of prompt/chosen/rejected, or prompt-only records) is a sibling function here
with its own `Prepared` and saved rows: it can reuse the sample steps
(`samples`) and the limits, and brings its own tokenizing and packing; the
stage chooses by record kind where it calls `conversations`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.data import limits, pack, samples, sources, stats
from finetune.data.control import ControlTokens, special_tokens, template_markers
from finetune.data.limits import Rows
from finetune.data.render import Renderer
from finetune.data.tokens import Tokens, tokenize_splits


@dataclass
class Prepared:
    """Conversations prepared for SFT, not yet saved: the rows kept and how the training rows pack."""

    stats: dict  # data_stats.json's content
    tokens: Tokens
    rows: Rows
    bins: list[list[int]]  # training rows packed: each bin lists positions in `rows.train`, longest bin first
    eval_messages: list[str]  # the conversation of each eval row (JSON text), for generation from its prompt


def conversations(cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console) -> Prepared:
    """Conversation records prepared for SFT: cleaned, split, tokenized with masked labels, limited, packed."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    loaded = sources.Loaded()
    renderer = Renderer(tokenizer, dc.train_on)
    control = ControlTokens(special_tokens(tokenizer) | template_markers(renderer.template_texts()))
    hard = limits.hard_limit(cfg)
    char_limit = limits.max_chars(tokenizer, hard)
    with progress(console) as bar:
        task = bar.add_task("read" if inp.dataset is None else "read (rows)", total=inp.size)
        records = sources.records(inp, loaded, lambda n: bar.advance(task, n))
        kept = samples.collect(records, loaded, dc, control, char_limit, tally)
        samples.check_input(loaded, dc, path, tally)
        kept = samples.near_deduplicate(kept, dc, tally, bar)
        train_convs, eval_convs = samples.split(kept, dc, tally)
        del kept  # the signatures: a MinHash row a sample, not needed from here on
    tokens = tokenize_splits(train_convs, eval_convs, renderer, dc.train_on, dc.num_proc)
    del train_convs
    rows = limits.apply(tokens, cfg, hard, tally.dropped)
    bins = _bins(rows, dc)
    eval_messages = [eval_convs[i - tokens.num_train] for i in rows.evals.tolist()]
    result = _stats(cfg, loaded, path, tally, char_limit, renderer, tokens, rows, bins)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return Prepared(result, tokens, rows, bins, eval_messages)


def progress(console):
    """The data stage's progress bars (rich, on stderr, gone when done): bytes or rows read, then each step."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    class _Amount(MofNCompleteColumn):
        """Bytes for the files being read or hashed, a count for rows and steps."""

        def render(self, task):
            if task.description in ("read", "fingerprint"):
                return DownloadColumn().render(task)
            return super().render(task)

    return Progress(
        TextColumn("data: {task.description:<18}"),
        BarColumn(),
        _Amount(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


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
