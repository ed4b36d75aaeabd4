"""The data stage: raw conversations in, packed and masked training rows out (`mode=data`).

    python -m finetune mode=data data.path=PATH model=tiny train.seq_len=N

The records are read, streamed (bad input located by file and line; devices,
FIFOs and sockets refused before they are opened) and, on a cache miss,
prepared by the objective's record kind (`conversations`, `preferences`, `prompts`: clean, deduplicate,
split, tokenize, limit, pack) and saved by it into a cache entry named by a fingerprint of everything the
preparation reads: the inputs' content, the tokenizer, its template, the data
config and the sequence length. The entry is then copied into `run_dir/data/`
(replaced only where finetune wrote it) and the copy checked against the
entry's checksums; one that does not match is rebuilt, with a warning. Its
statistics go to `run_dir/data_stats.json`. Training, evaluation and export
read it back with `load_prepared(run_dir)`, which checks the checksums again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import DataError, DiskFullError, is_disk_full
from finetune.data import cache, rows, sources
from finetune.modeling import models, tiny

log = logging.getLogger(__name__)

# Bump when the prepared format or the cleaning rules change: old cache entries stop matching.
PREPARED_VERSION = 2


def run(cfg: Config, run_dir: Path, *, tokenizer: Any = None) -> dict:
    """Prepare (or fetch from the cache) the training and eval data; write `data_stats.json`; return the stats."""
    run_dir = Path(run_dir)
    # Before any work: RUN_DIR/data is replaced at the end, and only when finetune wrote it.
    rundir.check_replaceable(run_dir / rundir.DATA_DIR, cache.published_before_markers)
    console = _console()
    tokenizer = tokenizer if tokenizer is not None else models.load_tokenizer(cfg.model)
    path = cfg.data.path or str(tiny.bundled_data_path(cfg.record_kind))
    entry, key, hit = _published_entry(cfg, tokenizer, path, run_dir, console)
    data = run_dir / rundir.DATA_DIR
    result = json.loads((data / cache.STATS_FILE).read_text())
    result["cache"] = {"fingerprint": key, "hit": hit, "dir": str(entry)}
    _copy_histogram(data, run_dir)
    rundir.write_json(run_dir / rundir.DATA_STATS_FILE, result)
    _report(console, result)
    return result


def check_prepared(run_dir: Path) -> Path:
    """RUN_DIR/data, once it is there and matches its checksums; else a one-line `DataError` saying how to
    get it back (the data stage copies it from the cache again, or prepares it anew)."""
    base = Path(run_dir) / rundir.DATA_DIR
    if not (base / rundir.DATA_TRAIN_DIR).is_dir():
        raise DataError(f"{base}: no prepared data; run the data stage (mode=data) first")
    try:
        cache.verify(base)
    except cache.Damaged as exc:
        raise DataError(f"{base}: the prepared data is damaged ({exc}); {_AGAIN}") from None
    return base


_AGAIN = "run the data stage again (mode=data, same settings) to copy it from the cache or prepare it anew"


def load_prepared(run_dir: Path):
    """(train, eval) `datasets.Dataset`s written by the data stage into `run_dir/data/`, checked against their
    checksums first (`check_prepared`).

    train: packed rows with `input_ids`, `labels` (-100 where masked), `position_ids` (restarting at every
    sample) and `seq_lengths`; row 0 holds the longest sample. eval: one conversation a row with `input_ids`,
    `labels` and `messages` (JSON text, for generation from the prompt).
    """
    from datasets import load_from_disk

    base = check_prepared(run_dir)
    try:
        return load_from_disk(str(base / rundir.DATA_TRAIN_DIR)), load_from_disk(
            str(base / rundir.DATA_EVAL_DIR)
        )
    except Exception as exc:  # pyarrow and datasets raise several types for a file they cannot read
        raise DataError(
            f"{base}: the prepared data cannot be read ({type(exc).__name__}: {exc}); {_AGAIN}"
        ) from None


# ---------------------------------------------------------------------------------------------------------------
# The cache entry


def _published_entry(
    cfg: Config, tokenizer: Any, path: str, run_dir: Path, console
) -> tuple[Path, str, bool]:
    """(cache entry, its fingerprint, hit): the entry for these inputs, prepared on a miss, copied into
    RUN_DIR/data and the copy checked; an entry that fails the check is rebuilt once, with a warning."""
    inp: Optional[sources.Input] = None
    if sources.is_local(path):  # devices, FIFOs and sockets are refused here, before anything is opened
        input_fp = sources.content_fingerprint(Path(path).expanduser())
    else:  # a hub name: its fingerprint is known once it is loaded
        inp, input_fp = sources.open_input(path, data=cfg.data)
    key = _fingerprint(cfg, input_fp, tokenizer)
    cache_root = cache.root(cfg.data.cache_dir)
    for leftover in cache.clean_partial(cache_root):
        log.info("removed %s, left by a data stage that did not finish", leftover)
    entry = cache.lookup(cache_root, key)
    hit = entry is not None
    if entry is None:
        entry = _build(cfg, tokenizer, path, inp, input_fp, cache_root, key, console)
    try:
        _publish(entry, run_dir)
        return entry, key, hit
    except cache.Damaged as exc:
        log.warning("data cache entry %s is damaged (%s): preparing it again", entry, exc)
        cache.discard(entry, str(exc))
    entry = _build(cfg, tokenizer, path, inp, input_fp, cache_root, key, console)
    try:
        _publish(entry, run_dir)
    except cache.Damaged as exc:
        raise DataError(
            f"data cache entry {entry} does not match its checksums right after it was prepared ({exc}): "
            f"check the disk under {cache_root}, or set data.cache_dir to another one"
        ) from None
    return entry, key, False


def _build(
    cfg: Config,
    tokenizer: Any,
    path: str,
    inp: Optional[sources.Input],
    input_fp: str,
    cache_root: Path,
    key: str,
    console,
) -> Path:
    """Prepare the data and save it as the cache entry `key` (its manifest written last)."""
    prepared: Any = None
    try:
        with cache.building(cache_root, key) as tmp:
            inp = inp if inp is not None else sources.open_input(path, input_fp, cfg.data)[0]
            # The objective's record kind (finetune/core/objectives.py) chooses the preparation.
            kind = cfg.record_module()
            # Its scratch files (texts, MinHash rows, token ids) live in the entry being built, gone before the manifest.
            prepared = kind.prepare(cfg, tokenizer, inp, path, console, scratch=tmp / ".scratch")
            prepared.stats["input"]["fingerprint"] = input_fp
            kind.save(prepared, tmp)
            prepared.stats["cache"] = {"fingerprint": key, "hit": False, "dir": str(cache_root / key)}
            rundir.write_json(tmp / cache.STATS_FILE, prepared.stats)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(
                cache_root, rows.approx_bytes(prepared), rundir.free_bytes(cache_root)
            ) from None
        raise
    return cache_root / key


def _fingerprint(cfg: Config, input_fp: str, tokenizer: Any) -> str:
    """The cache key: everything the preparation reads (the settings: `cache.config_key`, from the schema),
    less what cannot change its result."""
    return cache.fingerprint(
        {
            "version": PREPARED_VERSION,
            "record_kind": cfg.record_kind,
            "input": input_fp,
            "tokenizer": _tokenizer_fingerprint(tokenizer),
            "template": tokenizer.chat_template,
            "config": cache.config_key(cfg),
        }
    )


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256()
    # a processor (a model that takes images): its image rules, then its tokenizer
    image_processor = getattr(tokenizer, "image_processor", None)
    if image_processor is not None:
        h.update(image_processor.to_json_string().encode())
        tokenizer = tokenizer.tokenizer
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
    """The cache entry copied into RUN_DIR/data (reflinks where the file system shares blocks) and checked."""
    try:
        methods = cache.publish(entry, run_dir / rundir.DATA_DIR)
        log.info(
            "RUN_DIR/data copied from %s (%s)", entry, ", ".join(f"{n} by {m}" for m, n in methods.items())
        )
    except OSError as exc:
        if is_disk_full(exc):
            size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            raise DiskFullError(run_dir / rundir.DATA_DIR, size, rundir.free_bytes(run_dir)) from None
        raise


def _copy_histogram(data: Path, run_dir: Path) -> None:
    """RUN_DIR/data_tokens.png from the checked copy in RUN_DIR/data (a new file renamed into place)."""
    src = data / rundir.DATA_HISTOGRAM_FILE
    if not src.is_file():
        return
    dst = run_dir / rundir.DATA_HISTOGRAM_FILE
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        cache.copy_file(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    formats = ", ".join(f"{k} {v:,}" for k, v in (s.get("formats") or {}).items())
    console.print(
        f"data: {s['num_input']:,} input{f' ({formats})' if formats else ''}, dropped: {dropped}; "
        f"seq_len {s['seq_len']}; "
        f"{packed}cache {cache_line} {s['cache']['fingerprint']}"
    )


__all__ = ["run", "load_prepared", "check_prepared"]
