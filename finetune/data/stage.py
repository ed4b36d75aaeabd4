"""The data stage: raw conversations in, packed and masked training rows out (`mode=data`).

    python -m finetune mode=data data.path=PATH model=tiny train.seq_len=N

The records are read (bad input located by file and line) and, on a cache
miss, prepared (`prepare`: clean, deduplicate, split, tokenize, limit, pack) and
saved (`rows`) into a cache entry named by a fingerprint of everything the
preparation reads: the inputs' content, the tokenizer, its template, the data
config and the sequence length. The entry is then linked into `run_dir/data/`
(replaced only where finetune wrote it) and its statistics written to
`run_dir/data_stats.json`. Training reads it back with `load_prepared(run_dir)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import DataError, DiskFullError, is_disk_full
from finetune.data import cache, prepare, rows, sources
from finetune.modeling import models, tiny

# Bump when the prepared format or the cleaning rules change: old cache entries stop matching.
PREPARED_VERSION = 2


def run(cfg: Config, run_dir: Path, *, tokenizer: Any = None) -> dict:
    """Prepare (or fetch from the cache) the training and eval data; write `data_stats.json`; return the stats."""
    run_dir = Path(run_dir)
    # Before any work: RUN_DIR/data is replaced at the end, and only when finetune wrote it.
    rundir.check_replaceable(run_dir / rundir.DATA_DIR, cache.published_before_markers)
    console = _console()
    tokenizer = tokenizer if tokenizer is not None else models.load_tokenizer(cfg.model)
    path = cfg.data.path or str(tiny.bundled_data_path(cfg.objective.spec.record_kind))
    entry, key, hit = _cache_entry(cfg, tokenizer, path, console)
    result = json.loads((entry / cache.COMPLETE).read_text())
    result["cache"] = {"fingerprint": key, "hit": hit, "dir": str(entry)}
    _publish(entry, run_dir)
    rundir.write_json(run_dir / rundir.DATA_STATS_FILE, result)
    _report(console, result)
    return result


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


# ---------------------------------------------------------------------------------------------------------------
# The cache entry


def _cache_entry(cfg: Config, tokenizer: Any, path: str, console) -> tuple[Path, str, bool]:
    """(cache entry, its fingerprint, hit): the entry for these inputs, prepared and saved on a miss."""
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
    prepared: Optional[prepare.Prepared | prepare.PreparedPairs | prepare.PreparedPrompts] = None
    try:
        with cache.building(cache_root, key) as tmp:
            loaded = preloaded if preloaded is not None else sources.load(path)[0]
            # The objective's record kind (finetune/core/objectives.py) chooses the preparation.
            prepare_kind = prepare.RECORD_KINDS[cfg.objective.spec.record_kind]
            prepared = prepare_kind(cfg, tokenizer, loaded, path, console)
            prepared.stats["input"]["fingerprint"] = input_fp
            rows.save(prepared, tmp)
            prepared.stats["cache"] = {"fingerprint": key, "hit": False, "dir": str(cache_root / key)}
            rundir.write_json(tmp / cache.COMPLETE, prepared.stats)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(
                cache_root, rows.approx_bytes(prepared), rundir.free_bytes(cache_root)
            ) from None
        raise
    return cache_root / key, key, False


def _fingerprint(cfg: Config, input_fp: str, tokenizer: Any) -> str:
    """The cache key: everything the preparation reads, less what cannot change its result."""
    data = {k: v for k, v in asdict(cfg.data).items() if k not in ("name", "path", "num_proc", "cache_dir")}
    return cache.fingerprint(
        {
            "version": PREPARED_VERSION,
            "record_kind": cfg.objective.spec.record_kind,
            "input": input_fp,
            "tokenizer": _tokenizer_fingerprint(tokenizer),
            "template": tokenizer.chat_template,
            "data": data,
            "seq_len": cfg.train.seq_len,
            "max_position_embeddings": cfg.model.max_position_embeddings,
        }
    )


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


# ---------------------------------------------------------------------------------------------------------------
# Publishing and reporting


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


def _copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _console():
    from rich.console import Console

    return Console(stderr=True)


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
    # Preference pairs are not packed (one pair a row).
    packing = s.get("packing")
    packed = f"packing {packing['bins']:,} bins at {packing['efficiency']:.1%}; " if packing else ""
    console.print(
        f"data: {s['num_input']:,} input, dropped: {dropped}; seq_len {s['seq_len']}; "
        f"{packed}cache {cache_line} {s['cache']['fingerprint']}"
    )


__all__ = ["run", "load_prepared"]
