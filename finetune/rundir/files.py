"""Writing into a run directory: atomically (temporary file, flush, fsync, rename), scrubbed of secrets
(`finetune.core.secrets`), and never through a link finetune did not make.

A crash never leaves a half-written `config.yaml` or `plan.json`: the temporary file is renamed over the
name. rename(2) replaces the directory entry itself, so a symlink or hard link standing at the name would
be replaced, not written through; but a symlinked folder on the way would take the file elsewhere, and
in-place writers (the lock, the trainer's files, a shell's `>`) do follow links. So before anything is
written, `check_target` refuses (LaunchError: one line, exit 2, nothing written) when the name holds
anything but a regular file with one name (a symlink, a hard link, a FIFO, a device, a folder), and,
inside the run directory this process holds (`hold_root`, from `lock`), any symlinked folder between
the run directory and the file. `check_folder` does the same for a folder the trainer or a library
writes into, entry by entry. Refused rather than silently replaced: such a link was planted (on shared
scratch another user can), and whoever runs the job should see it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Optional

from finetune.core.errors import DiskFullError, LaunchError, is_disk_full
from finetune.core.secrets import scrub, scrub_text

SHELL_SUFFIXES = (".sh", ".sbatch")  # secrets in these become ${NAME}, read from the environment at run time

# The run directories this process holds (absolute, not resolved: a planted link must stay visible).
_roots: set[str] = set()


def hold_root(run_dir: Path) -> None:
    """Writes under `run_dir` from now on refuse a symlinked folder on the way (`lock` calls this)."""
    _roots.add(os.path.abspath(run_dir))


def free_bytes(path: Path) -> Optional[int]:
    """Free bytes on the file system holding `path` (its nearest existing parent), None if unknown."""
    import shutil

    for p in (Path(path), *Path(path).parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, what: str, done: str = "written") -> LaunchError:
    return LaunchError(
        f"{path}: {what} that finetune did not make; nothing was {done} through it: remove it (or choose "
        "another run_dir)"
    )


def _link(path: Path) -> str:
    try:
        return f"a symbolic link (to {os.readlink(path)})"
    except OSError:
        return "a symbolic link"


def _folders_on_the_way(folder: Path) -> list[Path]:
    """The folders from the held run directory (exclusive) down to `folder` (inclusive); [] outside one."""
    here = os.path.abspath(folder)
    roots = [r for r in _roots if here.startswith(r.rstrip(os.sep) + os.sep)]
    if not roots:
        return []
    root = max(roots, key=len)
    parts = Path(here).relative_to(root).parts
    return [Path(root, *parts[: i + 1]) for i in range(len(parts))]


def _check_folders(folder: Path) -> None:
    for p in _folders_on_the_way(folder):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return  # made by mkdir from here down
        if stat.S_ISLNK(st.st_mode):
            raise _refuse(p, _link(p))
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(p, _kind(st.st_mode))


def _check_entry(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, _link(path))
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, _kind(st.st_mode))
    if st.st_nlink > 1:
        raise _refuse(path, f"a file with {st.st_nlink} names (a hard link)")


def check_target(path: Path) -> None:
    """Refuse (LaunchError) to write the file `path` when a link or special file stands there or on the way."""
    path = Path(path)
    _check_folders(path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _check_entry(path, st)


def check_folder(folder: Path, deep: bool = True) -> None:
    """Refuse (LaunchError) a folder others write into (the trainer, tokenizers, TensorBoard) when it, a folder on
    the way, or anything in it (`deep`: at any depth) is a link or special file finetune did not make."""
    folder = Path(folder)
    _check_folders(folder)
    if not folder.is_dir():
        return
    for parent, dirs, names in os.walk(folder):
        for name in (*dirs, *names):
            path = Path(parent, name)
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                _check_entry(path, st)
        if not deep:
            return


def make_fresh_folder(folder: Path) -> None:
    """Create `folder` empty: an earlier one (ours: a real folder) is removed first, a link in its place refused."""
    import shutil

    folder = Path(folder)
    _check_folders(folder.parent)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(folder, _link(folder) if stat.S_ISLNK(st.st_mode) else _kind(st.st_mode))
        shutil.rmtree(folder)  # does not follow the links inside
    folder.mkdir(parents=True)


def read_own_text(path: Path) -> str:
    """The text of a file finetune wrote (config.yaml, plan.json, metrics.json, ...), opened without following
    a link or blocking on a FIFO: LaunchError when a link or special file stands there (a planted link to
    /dev/zero or a FIFO would otherwise hang the reader), FileNotFoundError when nothing does."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NOCTTY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, _link(path), "read") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, _kind(st.st_mode), "read")
        return f.read().decode("utf-8")


def atomic_write_bytes(path: Path, data: bytes, mode: Optional[int] = None) -> None:
    """`data` into `path` whole or not at all (see the module doc); `mode` sets its permissions before it
    takes the name (a script's 0700), else it keeps mkstemp's 0600."""
    path = Path(path)
    check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(path, len(data), free_bytes(path.parent)) from None
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFullError(path, len(data), free_bytes(path.parent)) from None
        raise


def atomic_write_text(path: Path, text: str, mode: Optional[int] = None) -> None:
    data = scrub_text(text, shell=Path(path).suffix in SHELL_SUFFIXES)
    atomic_write_bytes(path, data.encode(), mode)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(scrub(obj), indent=2, sort_keys=False) + "\n")
