"""One writer per run directory: an exclusive flock on RUN_DIR/.lock, held until the process ends.

The kernel drops an flock even on SIGKILL, so no stale lock survives a crash. The lock is handed down:
the training process the pipeline launches inherits the lock's file descriptor (`held_fds`,
FINETUNE_LOCK_FDS) and so holds the lock itself, also after its parent died, until it exits; a second
run never starts while any writer lives.

The lock file is opened without following a link (O_NOFOLLOW) and must be a regular file with one name:
a planted `.lock` symlink, hard link, FIFO or device is refused in one line, its target untouched.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Optional

from finetune.core.errors import DiskFullError, LaunchError, is_disk_full
from finetune.rundir.files import free_bytes, hold_root
from finetune.rundir.layout import LOCK_FDS_ENV, LOCK_FILE

log = logging.getLogger(__name__)

# Resolved run dir -> the open lock file's descriptor (kept for the process lifetime).
_held: dict[str, int] = {}


def _holders(fd: int) -> list[tuple[int, str]]:
    """(pid, host) of every process that held the lock, one line each: the taker, then who inherited it."""
    try:
        lines = os.pread(fd, 1 << 16, 0).decode(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        if fields and fields[0].isdigit():
            out.append((int(fields[0]), fields[1] if len(fields) > 1 else ""))
    return out


def _alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


def held_fds() -> list[int]:
    """The lock descriptors this process holds: a launched child inherits them and so holds the locks too."""
    return sorted(_held.values())


def _inherited(path: Path) -> Optional[int]:
    """A descriptor named in FINETUNE_LOCK_FDS that is open on this very lock file (same device and inode)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    for item in os.environ.get(LOCK_FDS_ENV, "").split(","):
        if not item.strip().isdigit():
            continue
        fd = int(item)
        try:
            fst = os.fstat(fd)
        except OSError:
            continue
        if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
            return fd
    return None


def _is_ancestor(pid: int) -> bool:
    import psutil

    try:
        return any(p.pid == pid for p in psutil.Process().parents())
    except psutil.Error:
        return False


def lock(run_dir: Path) -> None:
    """Make this process the only writer of `run_dir` (exclusive flock on RUN_DIR/.lock), or refuse.

    Re-entrant in one process. A process that inherited the lock's descriptor
    (the training worker the pipeline launched) takes the lock on it, so it holds
    the lock itself for as long as it lives, whether its parent lives or not; a
    process whose ancestor holds the lock (a torchrun rank) proceeds under it.
    Anyone else gets a LaunchError naming the living holders' pids and host.
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        return
    hold_root(run_dir)  # from here on no write under it goes through a symlinked folder
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, say so once
        log.warning("no fcntl on this platform: run directory %s is not locked", run_dir)
        return
    path = run_dir / LOCK_FILE
    me = f"{os.getpid()} {socket.gethostname()}\n"
    inherited = _inherited(path)
    if inherited is not None:  # the same open file description as the parent's: the lock is ours as well
        fcntl.flock(inherited, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = "".join(f"{p} {h}\n" for p, h in _holders(inherited))
        os.ftruncate(inherited, 0)
        os.pwrite(inherited, (before + me).encode(), 0)
        _held[key] = inherited
        return
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holders = _holders(fd)
        os.close(fd)
        here = socket.gethostname()
        if any(host == here and _is_ancestor(pid) for pid, host in holders):
            return  # launched by the holder: its lock covers us
        living = [(p, h) for p, h in holders if h != here or _alive(p)] or holders
        who = (
            ", ".join(f"pid {p}" + (f" on {h}" if h else "") for p, h in living)
            if living
            else "another process"
        )
        raise LaunchError(
            f"run_dir={run_dir}: in use by {who} (lock {path}); wait for it to finish, stop it, "
            "or choose another run_dir"
        ) from None
    except OSError as exc:  # a file system without locks (some network mounts): go on, but say so
        os.close(fd)
        log.warning("cannot lock %s (%s): make sure no other run writes there", path, exc.strerror)
        return
    os.ftruncate(fd, 0)
    try:
        os.pwrite(fd, me.encode(), 0)
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        if is_disk_full(exc):
            raise DiskFullError(path, len(me), free_bytes(run_dir)) from None
        raise
    _held[key] = fd


def _open_lock_file(path: Path) -> int:
    """RUN_DIR/.lock opened for reading and writing, created if missing, never through a link; refused
    (LaunchError) unless it is a regular file with one name."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOCTTY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        what = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a folder"}.get(exc.errno or 0)
        if what is None:
            raise LaunchError(f"{path}: cannot open the run directory's lock ({exc.strerror})") from None
        raise LaunchError(
            f"{path}: {what} that finetune did not make, where the run directory's lock goes; nothing was "
            "written: remove it (or choose another run_dir)"
        ) from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file (a FIFO, socket or device)"
    elif st.st_nlink > 1:
        problem = f"a file with {st.st_nlink} names (a hard link)"
    if problem:
        os.close(fd)
        raise LaunchError(
            f"{path}: {problem} that finetune did not make, where the run directory's lock goes; nothing was "
            "written: remove it (or choose another run_dir)"
        )
    return fd
