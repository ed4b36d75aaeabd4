"""The run directory: every stage reads what the previous one wrote here.

Files are written atomically (temporary file, flush, fsync, rename), so a
crash never leaves a half-written `config.yaml` or `plan.json` behind, and
scrubbed of secrets (`finetune.secrets`). `lock` makes one process the run
directory's only writer: `prepare` takes it, and it is held until the process
ends (the kernel drops an flock even on SIGKILL, so no stale lock survives a
crash); the training worker a holder launches runs under its parent's lock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from finetune.config import Config
from finetune.errors import ConfigError, LaunchError
from finetune.secrets import scrub, scrub_text

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
LOCK_FILE = ".lock"
SHELL_SUFFIXES = (".sh", ".sbatch")  # secrets in these become ${NAME}, read from the environment at run time


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(scrub_text(text, shell=path.suffix in SHELL_SUFFIXES))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(scrub(obj), indent=2, sort_keys=False) + "\n")


def prepare(cfg: Config) -> Path:
    """Create the run directory (or reuse it) and check it is writable."""
    run_dir = cfg.resolved_run_dir
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"run_dir={run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise LaunchError(f"run_dir={run_dir}: not writable")
    lock(run_dir)
    return run_dir


# ---------------------------------------------------------------- one writer per run directory

# Resolved run dir -> the open lock file's descriptor (kept for the process lifetime).
_held: dict[str, int] = {}


def _holder(path: Path) -> tuple[Optional[int], str]:
    try:
        fields = path.read_text().split()
    except OSError:
        return None, ""
    pid = int(fields[0]) if fields and fields[0].isdigit() else None
    return pid, (fields[1] if len(fields) > 1 else "")


def _is_ancestor(pid: int) -> bool:
    import psutil

    try:
        return any(p.pid == pid for p in psutil.Process().parents())
    except psutil.Error:
        return False


def lock(run_dir: Path) -> None:
    """Make this process the only writer of `run_dir` (exclusive flock on RUN_DIR/.lock), or refuse.

    Re-entrant in one process; a process whose ancestor holds the lock (the
    pipeline that launched this training worker) proceeds under it. Anyone else
    gets a LaunchError naming the holder's pid and host.
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, say so once
        log.warning("no fcntl on this platform: run directory %s is not locked", run_dir)
        return
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid, host = _holder(path)
        if pid is not None and host == socket.gethostname() and _is_ancestor(pid):
            return  # launched by the holder: its lock covers us
        who = f"pid {pid}" + (f" on {host}" if host else "") if pid is not None else "another process"
        raise LaunchError(
            f"run_dir={run_dir}: in use by {who} (lock {path}); wait for it to finish, stop it, "
            "or choose another run_dir"
        ) from None
    except OSError as exc:  # a file system without locks (some network mounts): go on, but say so
        os.close(fd)
        log.warning("cannot lock %s (%s): make sure no other run writes there", path, exc.strerror)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    os.fsync(fd)
    _held[key] = fd


def save_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved config that every rank and later stage reads (no command-line parsing there)."""
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_FILE
    check_resumable(cfg, run_dir)
    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.structured(scrub(asdict(cfg)))))
    return path


# What the checkpoints of a run depend on: resuming them under other values would be a different run.
_IGNORED = {"model": {"trust_remote_code", "allow_pickle_weights"}, "data": {"cache_dir", "num_proc"}}
_TRAIN_KEYS = ("seq_len", "batch_size", "seed")


def _resume_facts(d: dict) -> dict[str, Any]:
    facts = {}
    for section in ("model", "method", "data"):
        for key, value in (d.get(section) or {}).items():
            if key not in _IGNORED.get(section, ()):
                facts[f"{section}.{key}"] = value
    for key in _TRAIN_KEYS:
        facts[f"train.{key}"] = (d.get("train") or {}).get(key)
    return facts


def check_resumable(cfg: Config, run_dir: Path) -> None:
    """Refuse to overwrite the config of a run that has checkpoints with one its checkpoints do not belong to.

    Only when resuming (resume=true or a path): resume=false discards the checkpoints anyway.
    """
    import yaml

    from finetune import checkpoints

    path = Path(run_dir) / CONFIG_FILE
    if cfg.resume is False or not path.is_file() or not checkpoints.listing(Path(run_dir) / "checkpoints"):
        return
    try:
        old = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return
    before, after = _resume_facts(old), _resume_facts(scrub(asdict(cfg)))
    changed = [k for k in after if k in before and before[k] != after[k]]
    if changed:
        key = changed[0]
        raise ConfigError(
            f"run_dir={run_dir} has checkpoints trained with {key}={before[key]!r}, not {after[key]!r}"
            + (f" (and {len(changed) - 1} more change(s))" if len(changed) > 1 else "")
            + ": resume=false starts over (discarding them), or choose another run_dir"
        )


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
