"""The prepared-data cache: one folder per fingerprint, complete or absent, checked whenever it is used.

An entry is built in a temporary sibling (`.tmp-KEY-ID`, with a lock file beside it that its builder
holds while it lives) and renamed into place once `manifest.json`, written last, lists the size and
checksum of each of its files. Run directories never link into the cache: `publish` copies an entry
into RUN_DIR/data (a reflink where the file system can share blocks, else the kernel's copy), checks
the copy against the manifest and only then puts it in place, so a damaged cache file damages no run
directory, and a copy that does not match (a file truncated, changed, removed, a manifest lost)
raises `Damaged`: the stage then rebuilds the entry. `verify` checks RUN_DIR/data the same way when
training, evaluation or export read it. What a killed builder left (a `.tmp-*` folder whose lock
nobody holds, a `.stale-*` entry half removed) is removed by the next run (`clean_partial`).

Checksums are xxHash's XXH3-128 (the `xxhash` package datasets depends on): it detects damage, not
tampering (whoever can write the cache can write its manifest), at about 2.8 times SHA-256's speed on
one core here (2.71 against 0.98 GB/s; scripts/bench_data_memory.py, BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from finetune import rundir
from finetune.core import userfiles
from finetune.core.config.checks import AFFECTS_DATA
from finetune.core.errors import DataError

log = logging.getLogger(__name__)

# Ours, not datasets' fingerprints: those cache each `map` over Arrow files, while reading, cleaning, deduplication,
# the split and packing run outside `map` on in-memory rows; a hit here skips them all (BENCHMARKS.md: 20,000
# conversations, 8.0 s cold, 0.0 s hit; scripts/bench_library_parts.py).
MANIFEST = "manifest.json"  # written last: every other file's size and checksum
STATS_FILE = "stats.json"  # data_stats.json's content, less the cache's part
_TMP, _STALE, _LOCK = ".tmp-", ".stale-", ".lock"
_CHUNK = 8 << 20
_FICLONE = 0x40049409  # ioctl(dst, FICLONE, src): share src's blocks (btrfs, XFS, bcachefs; not ext4)
# What a file system says when it cannot share blocks, or copy_file_range cannot copy between these files.
_NO_REFLINK = {
    errno.EOPNOTSUPP,
    errno.ENOTTY,
    errno.EXDEV,
    errno.EINVAL,
    errno.ENOSYS,
    errno.EPERM,
    errno.EBADF,
}
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}


class Damaged(Exception):
    """A cache entry, or a copy of one, that does not match its manifest; the message says how."""


def default_root() -> Path:
    base = os.environ.get("FINETUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "finetune"
    )
    return Path(base) / "data"


def root(cache_dir: Optional[str]) -> Path:
    """The cache's folder: data.cache_dir, or the default; refused in one line where something other than a
    folder (a file, a device) stands there."""
    path = Path(cache_dir).expanduser() if cache_dir else default_root()
    key = "data.cache_dir" if cache_dir else "the data cache (FINETUNE_CACHE)"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise DataError(f"{key}={path}: cannot use it ({exc.strerror})") from None
    if not stat.S_ISDIR(mode):
        raise DataError(
            f"{key}={path}: is {userfiles.kind_of(mode)}, not a folder; name a folder for the cache"
        )
    return path


def config_key(cfg: Any) -> dict[str, Any]:
    """Every setting that changes what the data stage prepares, read from the schema: the fields whose
    metadata says `affects_data` (finetune/core/config/checks.py), and every field of a section whose root
    field says so (`data`) unless its own says otherwise. A new setting the preparation reads is marked
    where it is declared; tests/test_reliability_data_key.py finds any the preparation reads unmarked."""
    key: dict[str, Any] = {}
    for section in dataclasses.fields(cfg):
        node = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(node):
            continue
        whole = bool(section.metadata.get(AFFECTS_DATA))
        for f in dataclasses.fields(node):
            if f.metadata.get(AFFECTS_DATA, whole):
                key[f"{section.name}.{f.name}"] = getattr(node, f.name)
    return key


def fingerprint(parts: dict[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def lookup(cache_root: Path, key: str) -> Optional[Path]:
    """The entry for `key` if there is one (whether it is intact shows when it is published)."""
    entry = cache_root / key
    return entry if entry.is_dir() else None


# ---------------------------------------------------------------------------------------------------------------
# Checksums and the manifest


def checksum(path: Path) -> str:
    """XXH3-128 of a file's bytes (hex); a link is not followed."""
    import xxhash

    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MANIFEST)


def write_manifest(folder: Path) -> dict[str, dict]:
    """manifest.json in `folder`: the size and checksum of every other file under it; written last."""
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "xxh3_128": checksum(p)}
        for p in _files(folder)
    }
    _write_json(folder / MANIFEST, {"files": files})
    return files


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(folder: Path) -> dict[str, dict]:
    """The files a manifest lists (name -> bytes, checksum); `Damaged` when it is missing or unreadable."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        ok = isinstance(files, dict) and all(
            _safe_name(name)
            and isinstance(e, dict)
            and isinstance(e.get("bytes"), int)
            and isinstance(e.get("xxh3_128"), str)
            for name, e in files.items()
        )
    except FileNotFoundError:
        raise Damaged(f"no {MANIFEST} (not finished, or written before finetune checked its data)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Damaged(f"unreadable {MANIFEST} ({type(exc).__name__})") from None
    if not ok or STATS_FILE not in files:
        raise Damaged(f"{MANIFEST} does not list the entry's files")
    return files


def _safe_name(name: Any) -> bool:
    """A manifest name stays inside its folder: relative, no `..`."""
    if not isinstance(name, str) or not name:
        return False
    parts = PurePosixPath(name).parts
    return not PurePosixPath(name).is_absolute() and ".." not in parts and "." not in parts


def verify(folder: Path, files: Optional[dict[str, dict]] = None) -> None:
    """Every file the manifest lists is in `folder`, a regular file, of its size and checksum; else `Damaged`
    naming the first that is not."""
    files = read_manifest(folder) if files is None else files
    for name, entry in sorted(files.items()):
        path = folder / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise Damaged(f"{name} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise Damaged(f"{name} is not a regular file")
        if st.st_size != entry["bytes"]:
            raise Damaged(f"{name} has {st.st_size:,} bytes, {entry['bytes']:,} expected (truncated?)")
        if checksum(path) != entry["xxh3_128"]:
            raise Damaged(f"{name} does not match its checksum (changed on disk)")


# ---------------------------------------------------------------------------------------------------------------
# Building an entry, removing a damaged one and what killed builders left


@contextmanager
def building(cache_root: Path, key: str) -> Iterator[Path]:
    """Yield a temporary folder to fill; once it holds its manifest it becomes `cache_root/key` (another run's
    entry published meanwhile is kept instead); on failure it is removed."""
    import fcntl

    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f"{_TMP}{key}-{uuid.uuid4().hex[:8]}"
    lock = tmp.with_name(tmp.name + _LOCK)
    # The lock first, held before it appears under its name, then the folder: a folder without a held lock
    # beside it belongs to no living builder.
    unnamed = cache_root / f".lock-{uuid.uuid4().hex}"
    fd = os.open(unnamed, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(unnamed, lock)
        tmp.mkdir()
        yield tmp
        write_manifest(tmp)
        final = cache_root / key
        try:
            os.rename(tmp, final)
        except OSError as exc:  # another run published the same entry meanwhile: keep theirs
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.unlink(missing_ok=True)
        unnamed.unlink(missing_ok=True)
        os.close(fd)


def discard(entry: Path, why: str) -> None:
    """Move a damaged entry aside (a run copying from it keeps the files it opened) and remove it; a
    one-line `DataError` when the cache cannot be written, since the entry cannot be rebuilt there."""
    stale = entry.with_name(f"{_STALE}{entry.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, stale)
    except FileNotFoundError:  # another run removed it first
        return
    except OSError as exc:
        raise DataError(
            f"data cache entry {entry} is damaged ({why}) and cannot be removed to prepare it again "
            f"({exc.strerror}): remove it, or set data.cache_dir to a folder this user can write"
        ) from None
    shutil.rmtree(stale, ignore_errors=True)


def clean_partial(cache_root: Path) -> list[Path]:
    """Remove what killed runs left in the cache: temporary entries whose builder is gone (its lock free, or
    no lock: an older finetune's) and stale entries half removed; returns what it removed."""
    import fcntl

    try:
        names = os.listdir(cache_root)
    except OSError:
        return []
    removed = []
    for name in names:
        path = cache_root / name
        orphan = name.startswith(_TMP) and not name.endswith(_LOCK) and name + _LOCK not in names
        if name.startswith(_STALE) or orphan:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif name.startswith(_TMP) and name.endswith(_LOCK):
            try:
                fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its builder is alive
                os.close(fd)
                continue
            try:
                folder = path.with_name(name[: -len(_LOCK)])
                if folder.exists():
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder)
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
    return removed


# ---------------------------------------------------------------------------------------------------------------
# Copies into run directories


def copy_file(src: Path, dst: Path) -> str:
    """`src` copied to the new file `dst` (never through a link there); returns how: `reflink` (blocks shared,
    no bytes copied), `copy_file_range` (the kernel copies, server-side on NFS) or `copy`."""
    import fcntl

    nofollow = getattr(os, "O_NOFOLLOW", 0)
    with (
        os.fdopen(os.open(src, os.O_RDONLY | nofollow), "rb") as fin,
        os.fdopen(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow, 0o644), "wb") as fout,
    ):
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return "reflink"
        except OSError as exc:
            if exc.errno not in _NO_REFLINK:
                raise
        size, done = os.fstat(fin.fileno()).st_size, 0
        if hasattr(os, "copy_file_range"):
            try:
                while done < size:
                    n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
                    if n == 0:
                        break
                    done += n
                if done == size:
                    return "copy_file_range"
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise
        fin.seek(done)
        fout.seek(done)
        shutil.copyfileobj(fin, fout, _CHUNK)
        return "copy"


def published_before_markers(folder: Path) -> bool:
    """RUN_DIR/data as versions before the ownership marker published it: a copy of a cache entry."""
    return (
        (folder / STATS_FILE).is_file()
        and (folder / rundir.DATA_TRAIN_DIR).is_dir()
        and (folder / rundir.DATA_EVAL_DIR).is_dir()
    )


def publish(entry: Path, dst: Path) -> dict[str, int]:
    """Copy the entry's files into a temporary sibling of `dst`, check the copy against the entry's manifest
    and put it in place of `dst`; returns how many files each copy method took. `Damaged` when the entry
    does not match its manifest (then `dst` is left as it was).

    An existing `dst` is deleted only when finetune published it (`rundir.replace_tree`): a user's
    files in RUN_DIR/data are never removed; the stage stops with a one-line error instead.
    """
    files = read_manifest(entry)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    methods: dict[str, int] = {}
    try:
        tmp.mkdir(parents=True)
        for name in sorted(files):
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                how = copy_file(entry / name, target)
            except FileNotFoundError:
                raise Damaged(f"{name} is missing") from None
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise Damaged(f"{name} is a link, not the file it was") from None
            methods[how] = methods.get(how, 0) + 1
        verify(tmp, files)
        _write_json(tmp / MANIFEST, {"files": files})
        rundir.replace_tree(tmp, dst, legacy=published_before_markers)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return methods
