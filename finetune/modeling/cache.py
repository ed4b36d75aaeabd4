"""The model cache on disk: `$FINETUNE_CACHE` (default `~/.cache/finetune`), one folder per built thing.

A folder is built into a temporary sibling and renamed into place, so it is either complete or absent:
a crash, a full disk or a signal mid-build never leaves a half-built folder a later run would trust.
Two processes building the same folder at once both build; the first rename wins and the other's copy
is dropped. The tiny model and tokenizer (`finetune.modeling.tiny`) and the models converted from GGUF
files (`finetune.modeling.gguf`) live here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from finetune.core.errors import DiskFullError, is_disk_full
from finetune.rundir.files import free_bytes


def root() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune")


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(tmp)` into a temporary sibling and renamed into place if it is not there yet."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; use its copy
            if not target.is_dir():
                raise
    except Exception as exc:  # safetensors' own error on a full disk is no OSError
        if is_disk_full(exc):
            raise DiskFullError(target, None, free_bytes(target.parent)) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
