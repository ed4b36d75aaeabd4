"""The run directory: every stage reads what the previous one wrote here.

Files are written atomically (temporary file, flush, fsync, rename), so a
crash never leaves a half-written `config.yaml` or `plan.json` behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from finetune.config import Config
from finetune.errors import LaunchError

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def prepare(cfg: Config) -> Path:
    """Create the run directory (or reuse it) and check it is writable."""
    run_dir = cfg.resolved_run_dir
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"run_dir={run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise LaunchError(f"run_dir={run_dir}: not writable")
    return run_dir


def save_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved config that every rank and later stage reads (no command-line parsing there)."""
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_FILE
    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.structured(asdict(cfg))))
    return path


def load_config(run_dir: Path) -> Config:
    """Read `config.yaml` back into the typed `Config` (what workers do instead of parsing argv)."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise LaunchError(f"{path}: missing; run the pipeline (python -m finetune run_dir={run_dir}) first")
    node = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    cfg = OmegaConf.to_object(node)
    assert isinstance(cfg, Config)
    return cfg
