"""The prepared-data cache: one folder per fingerprint, published by an atomic rename.

A folder under the cache root either is complete or does not exist: it is
built in a temporary sibling and renamed into place, so an interrupted run
never leaves a half-written cache that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from finetune import rundir

# Ours, not datasets' fingerprints: those cache each `map` over Arrow files, while reading, cleaning, deduplication,
# the split and packing run outside `map` on in-memory rows; a hit here skips them all (BENCHMARKS.md: 20,000
# conversations, 8.0 s cold, 0.0 s hit; scripts/bench_library_parts.py).
COMPLETE = "stats.json"  # written last, inside the temporary folder


def default_root() -> Path:
    base = os.environ.get("FINETUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "finetune"
    )
    return Path(base) / "data"


def root(cache_dir: Optional[str]) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else default_root()


def fingerprint(parts: dict[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def lookup(cache_root: Path, key: str) -> Optional[Path]:
    entry = cache_root / key
    return entry if (entry / COMPLETE).is_file() else None


@contextmanager
def building(cache_root: Path, key: str) -> Iterator[Path]:
    """Yield a temporary folder to fill; on success it becomes `cache_root/key`, on failure it is removed."""
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        final = cache_root / key
        if final.exists():  # another run published the same entry meanwhile: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def published_before_markers(folder: Path) -> bool:
    """RUN_DIR/data as versions before the ownership marker published it: a copy of a cache entry."""
    return (
        (folder / COMPLETE).is_file()
        and (folder / rundir.DATA_TRAIN_DIR).is_dir()
        and (folder / rundir.DATA_EVAL_DIR).is_dir()
    )


def publish_copy(src: Path, dst: Path) -> None:
    """Replace `dst` by a hard-linked (or copied) tree of `src`, via a temporary sibling and a rename.

    An existing `dst` is deleted only when finetune published it (`rundir.replace_tree`): a user's
    files in RUN_DIR/data are never removed; the stage stops with a one-line error instead.
    """
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        rundir.replace_tree(tmp, dst, legacy=published_before_markers)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
