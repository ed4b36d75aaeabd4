"""A run directory is the project's own: `/`, a home directory, the installed package, a folder another
user owns and any existing non-empty folder without the ownership marker (`OWNER_FILE`) are refused, and
the marker is written into the folders finetune creates. Nothing the project did not write is deleted
(`replace_tree`).

Every entry counts: the marker and the lock vouch for a folder only as regular files with one name that
this user owns (a planted `.lock` symlink or `.finetune-run` from someone else makes the folder foreign).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from finetune.core.errors import ConfigError
from finetune.core.package import PACKAGE_DIR
from finetune.rundir.files import atomic_write_text
from finetune.rundir.layout import CONFIG_FILE, LOCK_FILE, OWNER_FILE


def _home_dirs() -> set[Path]:
    homes = {Path.home().resolve()}
    try:
        import pwd

        homes |= {Path(p.pw_dir).resolve() for p in pwd.getpwall() if p.pw_dir not in ("", "/")}
    except (ImportError, OSError, KeyError):  # not POSIX, or no passwd database
        pass
    return homes


def _package_dir() -> Path:
    return PACKAGE_DIR


def _mine(st: os.stat_result) -> bool:
    """Owned by this user (root may use what another user made: containers run as root on mounted folders)."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    return uid is None or uid == 0 or st.st_uid == uid


def _ours(path: Path) -> bool:
    """`path` is a file finetune could have written: regular (not a link), one name, this user's."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and _mine(st)


def is_owned(folder: Path) -> bool:
    """A folder finetune made: its marker, or (written before the marker existed) config.yaml next to .lock."""
    folder = Path(folder)
    return _ours(folder / OWNER_FILE) or (_ours(folder / CONFIG_FILE) and _ours(folder / LOCK_FILE))


def _foreign_entries(folder: Path) -> list[str]:
    """Entries of `folder` finetune did not write: all but a marker and a lock that are `_ours`."""
    return [p.name for p in folder.iterdir() if not (p.name in (LOCK_FILE, OWNER_FILE) and _ours(p))]


def mark_owned(folder: Path) -> None:
    path = Path(folder) / OWNER_FILE
    if not _ours(path):
        atomic_write_text(
            path, "written by finetune: this folder and what finetune wrote in it are its own\n"
        )


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run_dir the project must not own: `/`, a home directory, the installed package, or an
    existing non-empty folder that is not a run directory (stages replace files and folders in there)."""
    resolved = Path(run_dir).expanduser().resolve()
    why = None
    if resolved == Path(resolved.anchor):
        why = "the root of the file system"
    elif resolved in _home_dirs():
        why = "a home directory"
    elif resolved == _package_dir() or _package_dir() in resolved.parents:
        why = f"inside the installed finetune package ({_package_dir()})"
    elif resolved.is_dir() and not _mine(resolved.stat()):
        why = f"a folder owned by another user (uid {resolved.stat().st_uid}), who could change what the run reads"
    elif resolved.is_dir() and not is_owned(resolved) and _foreign_entries(resolved):
        names = sorted(_foreign_entries(resolved))
        held = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        why = f"an existing folder that is not a finetune run directory (no {OWNER_FILE}; it holds {held})"
    elif resolved.exists() and not resolved.is_dir():
        return  # mkdir names the problem
    if why:
        raise ConfigError(f"run_dir={run_dir}: {why}; choose a new or empty folder (runs/<name> by default)")


def replace_tree(tmp: Path, dst: Path, legacy: Optional[Callable[[Path], bool]] = None) -> None:
    """Put the folder `tmp` in place of `dst`, which is deleted only when finetune wrote it: its marker,
    or `legacy(dst)` for what versions before the marker wrote."""
    import shutil

    check_replaceable(dst, legacy)
    mark_owned(tmp)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def check_replaceable(dst: Path, legacy: Optional[Callable[[Path], bool]] = None) -> None:
    """Refuse (ConfigError) when `dst` exists and finetune did not write it (see `replace_tree`)."""
    if not (dst.exists() or dst.is_symlink()):
        return
    ours = dst.is_dir() and (_ours(dst / OWNER_FILE) or (legacy is not None and legacy(dst)))
    if dst.is_symlink() or not ours:
        raise ConfigError(
            f"{dst}: exists and was not written by finetune (no {OWNER_FILE}); move it out of the run "
            "directory (nothing was deleted)"
        )
