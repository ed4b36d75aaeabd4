"""The model folders a run ships, written whole and knowing what they were made from.

Training's output (RUN_DIR/adapter or RUN_DIR/model), the export (RUN_DIR/export) and the evaluation
(RUN_DIR/eval) are each built in a temporary sibling (`.NAME.tmp`), fsynced and renamed into place
(`staged`): a full disk, a crash or a signal mid-save leaves the previous folder as it was, and a full
disk is one line (`DiskFullError`, exit 2) with the temporary folder removed.

Training's output records its `Identity` in `identity.json`: a SHA-256 over the files that define the
model (weights and config), the step, the id of the training process that saved it. The export and the
evaluation record the identity of the trained output they were made from (`made_from.json`). When
training saves an output of another identity, the export and evaluation made from the previous one are
moved aside (`retire_stale`: RUN_DIR/superseded-export, superseded-eval), so serve.sh and report.md
never stand beside a model they were not made from; and the evaluation scores an export as `merged`
only when it was made from the output it scores as `trained`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core import userfiles
from finetune.core.errors import WRITE_FAILED, DiskFullError, LaunchError, is_disk_full
from finetune.rundir.checkpoints import SUPERSEDED_PREFIX

log = logging.getLogger(__name__)

# inside adapter/ or model/ (and so in export/adapter/): what the folder is
IDENTITY_FILE = rundir.IDENTITY_FILE
MADE_FROM_FILE = "made_from.json"  # inside export/ and eval/: the trained output they were made from
# The files whose bytes decide what the model computes; the tokenizer is the base model's, saved alongside.
DEFINING = ("*.safetensors", "*.safetensors.index.json", "config.json", "adapter_config.json")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Identity:
    """What a trained output is: its files' hash, and where it came from (unknown for files changed since)."""

    sha256: str  # over the defining files' names and SHA-256s
    folder: str  # adapter | model
    step: Optional[int] = None  # the optimizer step it was saved at
    run_id: Optional[str] = None  # the training process that saved it (metrics.json train.run_id)
    saved: Optional[str] = None  # when, UTC

    @property
    def short(self) -> str:
        return self.sha256[:12]

    def describe(self) -> str:
        """'adapter/ of step 20 (run 3f2a9c01d4e5, sha256 0123456789ab)'."""
        step = f"step {self.step}" if self.step is not None else "an unknown step"
        run = f"run {self.run_id}, " if self.run_id else ""
        return f"{self.folder}/ of {step} ({run}sha256 {self.short})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Optional[Identity]:
        if not isinstance(d, dict) or not isinstance(d.get("sha256"), str):
            return None
        step = d.get("step")
        return cls(
            sha256=d["sha256"],
            folder=str(d.get("folder") or "?"),
            step=step if isinstance(step, int) else None,
            run_id=d.get("run_id") if isinstance(d.get("run_id"), str) else None,
            saved=d.get("saved") if isinstance(d.get("saved"), str) else None,
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _defining_files(folder: Path) -> list[Path]:
    return sorted({p for pattern in DEFINING for p in folder.glob(pattern) if p.is_file()})


def _stats(folder: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in _defining_files(folder)}


def _combined(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def record(folder: Path, step: Optional[int], run_id: Optional[str], name: str) -> Identity:
    """Hash `folder`'s defining files and write its identity.json; `name` is the folder it ships as."""
    folder = Path(folder)
    hashes = {p.name: _sha256(p) for p in _defining_files(folder)}
    saved = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    identity = Identity(_combined(hashes), name, step, run_id, saved)
    rundir.write_json(
        folder / IDENTITY_FILE, {"identity": identity.to_dict(), "files": hashes, "stats": _stats(folder)}
    )
    return identity


def identity_of(folder: Path) -> Optional[Identity]:
    """The identity of the trained output in `folder` (None: no model files there).

    identity.json is trusted while the files keep the sizes and times it recorded; otherwise (copied,
    changed, saved by hand or by a version without it) the files are hashed again, and the step and run
    are known only if the hash still matches.
    """
    folder = Path(folder)
    files = _defining_files(folder)
    if not files:
        return None
    try:
        doc = json.loads((folder / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        doc = {}
    recorded = Identity.from_dict(doc.get("identity")) if isinstance(doc, dict) else None
    if recorded is not None and doc.get("stats") == _stats(folder):
        return recorded
    sha = _combined({p.name: _sha256(p) for p in files})
    if recorded is not None and recorded.sha256 == sha:
        return recorded
    if recorded is not None:
        log.warning(
            "%s: its files changed since training recorded them (%s); step and run unknown",
            folder,
            recorded.describe(),
        )
    return Identity(sha, folder.name)


def write_made_from(folder: Path, identity: Optional[Identity]) -> None:
    """Record in `folder` (an export or evaluation being staged) the trained output it was made from."""
    rundir.write_json(Path(folder) / MADE_FROM_FILE, {"trained": identity.to_dict() if identity else None})


def made_from(folder: Path) -> Optional[Identity]:
    """The trained output `folder` was made from; None when it records none (or predates the record)."""
    try:
        doc = json.loads((Path(folder) / MADE_FROM_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Identity.from_dict(doc.get("trained")) if isinstance(doc, dict) else None


def same_model(a: Optional[Identity], b: Optional[Identity]) -> bool:
    return a is not None and b is not None and a.sha256 == b.sha256


def retire_stale(run_dir: Path, identity: Identity) -> list[Path]:
    """Move RUN_DIR/export and RUN_DIR/eval aside when they were made from another trained output than
    `identity` (the one training just saved): to RUN_DIR/superseded-export and superseded-eval, each
    replacing an earlier one. Returns where they went."""
    moved = []
    for folder in (rundir.export_dir(run_dir), rundir.eval_dir(run_dir)):
        if not folder.is_dir() or folder.is_symlink():
            continue
        source = made_from(folder)
        if same_model(source, identity):
            continue
        aside = folder.with_name(SUPERSEDED_PREFIX + folder.name)
        _remove(aside)
        folder.rename(aside)
        moved.append(aside)
        was = source.describe() if source else "an unrecorded model"
        log.warning(
            "%s/ was made from %s; training saved %s: moved to %s/",
            folder.name,
            was,
            identity.describe(),
            aside.name,
        )
    return moved


# ---------------------------------------------------------------- written whole


def _remove(path: Path) -> None:
    """Delete a leftover file, folder or link (a link itself, never what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_tree(folder: Path) -> None:
    """Every file, then every folder, on disk before the rename makes them the output."""
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
        flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
        except OSError:  # a folder some file systems will not open: nothing more to flush there
            continue
        try:
            os.fsync(fd)
        except OSError as exc:
            if is_disk_full(exc):
                raise
        finally:
            os.close(fd)


def _disk_full(exc: BaseException, final: Path, needed: Optional[int]) -> Optional[DiskFullError]:
    """A DiskFullError for `exc` when it is a failed write for want of space (measured before cleaning up)."""
    free = rundir.free_bytes(final.parent)
    if is_disk_full(exc):
        return DiskFullError(final, needed, free)
    # PyTorch's C++ writer (training_args.bin) says only that the write failed: full if the space is short.
    write_failed = isinstance(exc, RuntimeError) and any(s in str(exc) for s in WRITE_FAILED)
    if write_failed and free is not None and needed is not None and free < needed:
        return DiskFullError(final, needed, free)
    return None


@contextmanager
def staged(final: Path, needed_bytes: Optional[int] = None, *, writer: bool = True) -> Iterator[Path]:
    """Yield a fresh `.NAME.tmp` beside `final` to write into; on success it replaces `final` whole.

    On any failure (a signal included) the temporary folder is removed and `final` is left as it was; a full
    disk becomes a DiskFullError naming `final`, the bytes free and `needed_bytes`. `writer=False` (ranks
    other than 0, which take part in a gathered save but write nothing) only yields the path.
    """
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    if not writer:
        yield tmp
        return
    old = final.with_name(f".{final.name}.old")
    for leftover in (tmp, old):  # a crash or kill -9 mid-save in an earlier run
        _remove(leftover)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        _fsync_tree(tmp)
        if final.exists() or final.is_symlink():
            final.rename(old)
        tmp.rename(final)
    except BaseException as exc:
        full = _disk_full(exc, final, needed_bytes)
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():  # failed between the two renames: the previous one back
            old.rename(final)
        if full is not None:
            raise full from None
        raise
    _remove(old)


# ---------------------------------------------------------------- an adapter checked before it is loaded

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# An adapter's small JSON files (its config, identity.json): a few kilobytes; far more is not one.
_JSON_LIMIT = 16 << 20


def check_adapter(folder: Path, base: Optional[str] = None) -> None:
    """Refuse, in one line (`LaunchError`), an adapter that cannot be what it claims before any of it is
    loaded into a model: its config or weights missing, files that no longer match the SHA-256s its
    identity.json records, weights that cannot be read (truncated) or hold NaN or inf, or a config naming
    another base model than `base` (the one it is about to be put on)."""
    folder = Path(folder)
    config, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for path in (config, weights):
        if not path.exists():
            raise LaunchError(
                f"{path}: missing, so {folder} is not a complete adapter; train it again (mode=train)"
            )
        userfiles.check_regular(path, "adapter", LaunchError)  # a FIFO or a device is never opened
    identity = folder / IDENTITY_FILE
    try:
        text = userfiles.read_text(identity, "adapter", _JSON_LIMIT, LaunchError) if identity.exists() else ""
        doc = json.loads(text) if text else {}
        recorded = doc["files"] if isinstance(doc, dict) and isinstance(doc.get("files"), dict) else {}
    except ValueError:
        recorded = {}
    for name, sha in recorded.items():
        # Files of this folder only: a name that leaves it ('/dev/zero', '../x') is not one training recorded.
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise LaunchError(f"{identity}: names {str(name)[:80]!r}, not a file of {folder}; train it again")
        path = folder / name
        if path.exists():
            userfiles.check_regular(path, "adapter", LaunchError)
        now = _sha256(path) if path.is_file() else None
        if now != sha:
            raise LaunchError(
                f"{path}: does not match the SHA-256 its {IDENTITY_FILE} records ({str(sha)[:12]}, now "
                f"{(now or 'missing')[:12]}): changed or damaged since training saved it; train it again"
            )
    try:
        settings = json.loads(userfiles.read_text(config, "adapter", _JSON_LIMIT, LaunchError))
        claimed = settings.get("base_model_name_or_path") if isinstance(settings, dict) else None
    except ValueError as exc:
        raise LaunchError(f"{config}: cannot be read ({exc})") from None
    if base and isinstance(claimed, str) and claimed and not _same_base(claimed, base):
        raise LaunchError(
            f"{folder}: an adapter of {claimed}, not of {base}, the base it would be put on; point it at an "
            "adapter trained on this model"
        )
    _check_weights(weights)


def _same_base(claimed: str, base: str) -> bool:
    """The same model: equal names (a hub id), or folders of the same name (the cache moves between machines)."""
    return claimed == base or Path(claimed).name == Path(base).name


def _check_weights(weights: Path) -> None:
    """Every tensor readable and finite (a truncated file, or an adapter trained into NaN, refused)."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            names = f.keys()  # (a safetensors handle is not iterable)
            for key in names:
                tensor = f.get_tensor(key)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise LaunchError(
                        f"{weights}: tensor {key} holds NaN or inf values; the adapter is unusable (train it again, "
                        "with a lower method.learning_rate)"
                    )
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise LaunchError(
            f"{weights}: cannot be read ({first}): truncated or damaged; train it again"
        ) from None
