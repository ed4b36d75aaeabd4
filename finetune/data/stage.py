"""The data stage: raw conversations in, packed and masked training rows out (`mode=data`).

    python -m finetune mode=data data.path=PATH model=tiny train.seq_len=N

Steps: read (bad input located by file and line) -> map to messages -> clean
(turn order, empty, too long by characters, control tokens in content, personal
data, exact and near duplicates) -> held-out
split by seed (after deduplication; train keeps no exact or near duplicate of
an eval sample) -> render with the tokenizer's chat template and mask labels ->
length limits -> resolve `train.seq_len=auto` -> best-fit-decreasing packing.

The result is cached under a fingerprint of the inputs' content, the
tokenizer, its template, the data config and the sequence length, then linked
into `run_dir/data/`; statistics go to `run_dir/data_stats.json`. Training
reads it back with `load_prepared(run_dir)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError, DiskFullError, is_disk_full
from finetune.data import cache, limits, pack, samples, sources, stats
from finetune.data.control import ControlTokens, special_tokens, template_markers
from finetune.data.formats import Messages
from finetune.data.limits import Rows
from finetune.data.render import Renderer
from finetune.data.tokens import Tokens, tokenize_splits
from finetune.modeling import models, tiny

# Bump when the prepared format or the cleaning rules change: old cache entries stop matching.
PREPARED_VERSION = 2


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(
        backend.to_str().encode()
        if backend is not None
        else repr(sorted(tokenizer.get_vocab().items())).encode()
    )
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _fingerprint(cfg: Config, input_fp: str, tokenizer: Any) -> str:
    data = {k: v for k, v in asdict(cfg.data).items() if k not in ("name", "path", "num_proc", "cache_dir")}
    return cache.fingerprint(
        {
            "version": PREPARED_VERSION,
            "input": input_fp,
            "tokenizer": _tokenizer_fingerprint(tokenizer),
            "template": tokenizer.chat_template,
            "data": data,
            "seq_len": cfg.train.seq_len,
            "max_position_embeddings": cfg.model.max_position_embeddings,
        }
    )


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("data: {task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


# ---------------------------------------------------------------------------------------------------------------
# The stage


def run(cfg: Config, run_dir: Path, *, tokenizer: Any = None) -> dict:
    """Prepare (or fetch from the cache) the training and eval data; write `data_stats.json`; return the stats."""
    run_dir = Path(run_dir)
    # Before any work: RUN_DIR/data is replaced at the end, and only when finetune wrote it.
    rundir.check_replaceable(run_dir / rundir.DATA_DIR, cache.published_before_markers)
    console = _console()
    tokenizer = tokenizer if tokenizer is not None else models.load_tokenizer(cfg.model)
    path = cfg.data.path or str(tiny.bundled_data_path())
    entry, key, hit = _cache_entry(cfg, tokenizer, path, console)
    result = json.loads((entry / cache.COMPLETE).read_text())
    result["cache"] = {"fingerprint": key, "hit": hit, "dir": str(entry)}
    _publish(entry, run_dir)
    rundir.write_json(run_dir / rundir.DATA_STATS_FILE, result)
    _report(console, result)
    return result


def _cache_entry(cfg: Config, tokenizer: Any, path: str, console) -> tuple[Path, str, bool]:
    """(cache entry, its fingerprint, hit): the entry for these inputs, prepared (`_prepare`) on a miss."""
    local = Path(path).expanduser()
    preloaded = None
    if local.exists():
        input_fp = sources.content_fingerprint(local)
    else:  # a hub name: its fingerprint is known once it is loaded
        preloaded, input_fp = sources.load(path)
    key = _fingerprint(cfg, input_fp, tokenizer)
    cache_root = cache.root(cfg.data.cache_dir)
    entry = cache.lookup(cache_root, key)
    if entry is not None:
        return entry, key, True
    prepared: dict = {}
    try:
        with cache.building(cache_root, key) as tmp:
            loaded = preloaded if preloaded is not None else sources.load(path)[0]
            prepared = _prepare(cfg, tokenizer, loaded, path, console)
            prepared["stats"]["input"]["fingerprint"] = input_fp
            _save(prepared, tmp)
            prepared["stats"]["cache"] = {"fingerprint": key, "hit": False, "dir": str(cache_root / key)}
            rundir.write_json(tmp / cache.COMPLETE, prepared["stats"])
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(
                cache_root, _prepared_bytes(prepared), rundir.free_bytes(cache_root)
            ) from None
        raise
    return cache_root / key, key, False


def _publish(entry: Path, run_dir: Path) -> None:
    """The cache entry into RUN_DIR/data (hard links where it can: no bytes), its histogram beside it."""
    try:
        cache.publish_copy(entry, run_dir / rundir.DATA_DIR)
        hist = entry / rundir.DATA_HISTOGRAM_FILE
        if hist.is_file():
            _copy_file(hist, run_dir / rundir.DATA_HISTOGRAM_FILE)
    except OSError as exc:
        if is_disk_full(exc):
            size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            raise DiskFullError(run_dir / rundir.DATA_DIR, size, rundir.free_bytes(run_dir)) from None
        raise


def _prepared_bytes(prepared: dict) -> Optional[int]:
    """About what the cache entry takes: three 8-byte columns a training token, two an eval token."""
    tokens = (prepared.get("stats") or {}).get("tokens")
    if not tokens:
        return None
    return 24 * int(tokens["train_total"]) + 16 * int(tokens["eval_total"])


def _copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _prepare(cfg: Config, tokenizer: Any, loaded: sources.Loaded, path: str, console) -> dict:
    """What a cache miss runs: messages -> clean -> deduplicate -> split -> tokenize -> length limits -> pack."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    renderer = Renderer(tokenizer, dc.train_on)
    control = ControlTokens(special_tokens(tokenizer) | template_markers(renderer.template_texts()))
    hard = limits.hard_limit(cfg)
    char_limit = limits.max_chars(tokenizer, hard)
    with _progress(console) as progress:
        convs = samples.read(loaded, dc, path, tally, progress)
        kept = samples.cleaned(convs, dc, control, char_limit, tally, progress)
        kept_unique = samples.deduplicate(kept, dc, tally, progress)
        train_convs, eval_convs = samples.split(kept_unique, dc, tally)
    tokens = tokenize_splits(train_convs, eval_convs, renderer, dc.train_on, dc.num_proc)
    rows = limits.apply(tokens, cfg, hard, tally.dropped)
    train, evals = _packed(tokens, rows, eval_convs, dc)
    result = _stats(cfg, loaded, path, tally, char_limit, renderer, tokens, rows, train["bins"])
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return {"stats": result, "train": train, "evals": evals}


def _packed(tokens: Tokens, rows: Rows, eval_convs: list[Messages], dc: DataConfig) -> tuple[dict, dict]:
    """(train, eval) as `_save` writes them: training rows packed into bins (best fit decreasing, longest
    first), eval rows one conversation each with its messages."""
    train_lengths = rows.lengths[rows.train].tolist()
    if dc.packing:
        bins = pack.best_fit_decreasing(train_lengths, rows.seq_len)
    else:
        bins = [[i] for i in range(len(rows.train))]
    bins = pack.order_bins(bins, train_lengths, dc.seed)
    arrays = {"ids": tokens.ids, "labels": tokens.labels, "starts": tokens.starts, "lengths": rows.lengths}
    messages = [eval_convs[i - tokens.num_train] for i in rows.evals.tolist()]
    return {"rows": rows.train, "bins": bins, **arrays}, {"rows": rows.evals, "messages": messages, **arrays}


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
        "bad_input_examples": list(sources.iter_where(loaded.bad)),
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


@contextmanager
def _quiet_datasets():
    """datasets' own progress bars off (saving a few files needs none), restored afterwards."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _save(prepared: dict, out: Path) -> None:
    with _quiet_datasets():
        _save_rows(prepared, out)


def _save_rows(prepared: dict, out: Path) -> None:
    import pyarrow as pa
    from datasets import Dataset

    train, evals = prepared["train"], prepared["evals"]
    groups = [[int(train["rows"][i]) for i in b] for b in train["bins"]]
    ids = pack.gather_rows(train["ids"], train["starts"], train["lengths"], groups)
    labels = pack.gather_rows(train["labels"], train["starts"], train["lengths"], groups)
    Dataset(
        pa.table(
            {
                "input_ids": ids["tokens"],
                "labels": labels["tokens"],
                "position_ids": ids["position_ids"],
                "seq_lengths": ids["seq_lengths"],
            }
        )
    ).save_to_disk(str(out / rundir.DATA_TRAIN_DIR))
    singles = [[int(r)] for r in evals["rows"]]
    eval_ids = pack.gather_rows(evals["ids"], evals["starts"], evals["lengths"], singles)
    eval_labels = pack.gather_rows(evals["labels"], evals["starts"], evals["lengths"], singles)
    messages = pa.array([json.dumps(m, ensure_ascii=False) for m in evals["messages"]], pa.string())
    Dataset(
        pa.table({"input_ids": eval_ids["tokens"], "labels": eval_labels["tokens"], "messages": messages})
    ).save_to_disk(
        str(out / rundir.DATA_EVAL_DIR), num_shards=1
    )  # one shard even when empty (eval_fraction=0)
    lengths = train["lengths"]
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {"train": lengths[train["rows"]].tolist(), "eval": lengths[evals["rows"]].tolist()},
        prepared["stats"]["seq_len"],
    )


def load_prepared(run_dir: Path):
    """(train, eval) `datasets.Dataset`s written by the data stage into `run_dir/data/`.

    train: packed rows with `input_ids`, `labels` (-100 where masked), `position_ids` (restarting at every
    sample) and `seq_lengths`; row 0 holds the longest sample. eval: one conversation a row with `input_ids`,
    `labels` and `messages` (JSON text, for generation from the prompt).
    """
    from datasets import load_from_disk

    base = Path(run_dir) / rundir.DATA_DIR
    if not (base / rundir.DATA_TRAIN_DIR).is_dir():
        raise DataError(f"{base}: no prepared data; run the data stage (mode=data) first")
    return load_from_disk(str(base / rundir.DATA_TRAIN_DIR)), load_from_disk(str(base / rundir.DATA_EVAL_DIR))


def _report(console, s: dict) -> None:
    from rich.table import Table

    t = Table(title="data", show_header=True, header_style="bold")
    for col in ("split", "samples", "tokens", "p50", "p95", "max"):
        t.add_column(col, justify="right" if col != "split" else "left")
    for name in ("train", "eval"):
        sp = s["splits"][name]
        t.add_row(
            name, f"{sp['count']:,}", f"{sp['total']:,}", str(sp["p50"]), str(sp["p95"]), str(sp["max"])
        )
    console.print(t)
    dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "none"
    cache_line = "hit" if s["cache"]["hit"] else "miss (prepared and stored)"
    console.print(
        f"data: {s['num_input']:,} input, dropped: {dropped}; seq_len {s['seq_len']}; "
        f"packing {s['packing']['bins']:,} bins at {s['packing']['efficiency']:.1%}; "
        f"cache {cache_line} {s['cache']['fingerprint']}"
    )


__all__ = ["run", "load_prepared"]
