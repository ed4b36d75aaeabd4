"""Writing into a run directory: atomically (temporary file, flush, fsync, rename), so a crash never
leaves a half-written `config.yaml` or `plan.json` behind, and scrubbed of secrets (`finetune.core.secrets`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from finetune.core.errors import DiskFullError, is_disk_full
from finetune.core.secrets import scrub, scrub_text

SHELL_SUFFIXES = (".sh", ".sbatch")  # secrets in these become ${NAME}, read from the environment at run time


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


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = scrub_text(text, shell=path.suffix in SHELL_SUFFIXES)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(path, len(data.encode()), free_bytes(path.parent)) from None
        raise
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFullError(path, len(data.encode()), free_bytes(path.parent)) from None
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(scrub(obj), indent=2, sort_keys=False) + "\n")
