"""A run directory is the project's own: `/`, a home directory, the installed package and any existing
non-empty folder without the ownership marker (`OWNER_FILE`) are refused, and the marker is written into
the folders finetune creates. Nothing the project did not write is deleted (`replace_tree`)."""

from __future__ import annotations

import os
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


def is_owned(folder: Path) -> bool:
    """A folder finetune made: its marker, or (written before the marker existed) config.yaml next to .lock."""
    folder = Path(folder)
    return (folder / OWNER_FILE).is_file() or (
        (folder / CONFIG_FILE).is_file() and (folder / LOCK_FILE).is_file()
    )


def _foreign_entries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name not in (LOCK_FILE, OWNER_FILE)]


def mark_owned(folder: Path) -> None:
    path = Path(folder) / OWNER_FILE
    if not path.is_file():
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
    elif resolved.is_dir() and not is_owned(resolved) and _foreign_entries(resolved):
        why = (
            f"an existing folder that is not a finetune run directory (no {OWNER_FILE}; it holds other files)"
        )
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
    ours = dst.is_dir() and ((dst / OWNER_FILE).is_file() or (legacy is not None and legacy(dst)))
    if dst.is_symlink() or not ours:
        raise ConfigError(
            f"{dst}: exists and was not written by finetune (no {OWNER_FILE}); move it out of the run "
            "directory (nothing was deleted)"
        )
