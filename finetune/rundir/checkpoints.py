"""Checkpoints a crash cannot corrupt: staged, checksummed, renamed into place; the last K kept.

A checkpoint is written into `checkpoints/.staging/checkpoint-N` (by the
trainer, every rank), then rank 0 fsyncs every file, records each file's size
and SHA-256 in `manifest.json` (written last), fsyncs the folder and renames
it to `checkpoints/checkpoint-N`. A folder named `checkpoint-N` therefore is
either complete or was damaged afterwards; `verify` tells which, and
`last_complete` walks back from the newest to the first that verifies, so a
checkpoint truncated by a full disk or a dying node is skipped in favour of the
previous one. `rotate` keeps the newest K complete checkpoints
(`train.save_total_limit`) and deletes damaged ones. `resume_checkpoint` and
`prepare_resume` apply the `resume` setting (true, false, or a checkpoint).

Hashing reads each file once after it is written (from the page cache, about
1 GB/s); verification on resume reads it again. For a resumable full
fine-tuning checkpoint of a 70B model (about 1 TB) that is minutes; LoRA and
QLoRA checkpoints are small.

A checkpoint whose checksums match can still be unusable (damaged before it was sealed, or rewritten
together with its manifest): `verify` also opens what the trainer reads on resume, as it reads it
(`_unloadable`: the trainer state, the RNG, optimizer and scheduler states with `weights_only`, the
adapter or model's safetensors headers, the JSON files), so such a checkpoint is skipped like a
truncated one, in one line that names it and what is used instead. DeepSpeed loads its shards
(`global_step*/*.pt`) without `weights_only`, so a pickle payload there would run: their pickles are
read, not run, and any callable they name outside torch's allowlist and DeepSpeed's own classes
(`posix.system`, say) refuses the checkpoint. FSDP's sharded folders (`*.distcp`, `.metadata`) are
covered by the checksums only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Optional, Union

from finetune.core import userfiles
from finetune.core.errors import ConfigError
from finetune.rundir.files import atomic_write_text, check_folder

log = logging.getLogger(__name__)

# Ours, not save_total_limit + get_last_checkpoint: those take the newest folder by name, a truncated one
# included (scripts/bench_library_parts.py, BENCHMARKS.md), and rotation could delete the last good one.
MANIFEST = "manifest.json"
# A manifest lists a checkpoint's files: kilobytes; far more is not one.
_MANIFEST_LIMIT = 16 << 20
# What transformers writes into each checkpoint: the step, the log history, the callbacks' state.
TRAINER_STATE_FILE = "trainer_state.json"
STAGING_DIR = ".staging"
SUPERSEDED_PREFIX = "superseded-"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 8 << 20
# Checkpoints whose checksums verified in this process: path -> every file's (name, size, mtime_ns, sha256).
_verified: dict[str, tuple] = {}


def step_of(path: Path) -> Optional[int]:
    """N for a folder named checkpoint-N, else None."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def listing(folder: Path) -> list[Path]:
    """Every `checkpoint-N` folder under `folder`, oldest step first (complete or not)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    # A symlink is never a checkpoint: resuming would read, and rotation delete, what it points to.
    found = [p for p in folder.iterdir() if step_of(p) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: step_of(p) or 0)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # some file systems do not open folders; nothing more to flush there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MANIFEST)


def write_manifest(folder: Path, step: int) -> dict:
    """fsync every file, then write manifest.json (sizes and SHA-256 of every file) and fsync it too."""
    folder = Path(folder)
    entries = {}
    for path in _files(folder):
        _fsync_file(path)
        entries[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    for sub in sorted({p.parent for p in _files(folder)}, key=lambda p: -len(p.parts)):
        _fsync_dir(sub)
    manifest = {"step": step, "created": time.time(), "files": entries}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_dir(folder)
    return manifest


def verify(folder: Path, checksums: bool = True) -> Optional[str]:
    """None when the checkpoint is complete; else why not (missing manifest, a file missing, short, or changed).

    `checksums=False` compares sizes only (what rotation uses: cheap, catches truncation).
    Checksums that verified once in this process are not recomputed while no file's
    size or modification time has changed (preflight, then the resume itself).
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not os.path.lexists(path):
        return f"no {MANIFEST} (written last, so the save did not finish)"
    try:
        # a checkpoint named by resume=PATH is the user's folder: its manifest a regular file, bounded
        manifest = json.loads(userfiles.read_text(path, "resume", _MANIFEST_LIMIT))
        files = manifest["files"]
    except ConfigError as exc:
        return f"unreadable {MANIFEST} ({str(exc).split(': ', 1)[-1]})"
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST} ({type(exc).__name__})"
    if not files or not isinstance(files, dict):
        return "empty checkpoint"
    stamps = []
    for name, entry in sorted(files.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{MANIFEST} names {name!r}, outside the checkpoint"
        try:
            st = os.lstat(folder / name)
            size, sha = int(entry["bytes"]), str(entry["sha256"])
        except OSError:
            return f"{name} is missing"
        except (KeyError, TypeError, ValueError) as exc:
            return f"unreadable {MANIFEST} ({type(exc).__name__})"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file (a link or special file finetune did not make)"
        if st.st_size != size:
            return f"{name} has {st.st_size} bytes, {size} expected (truncated?)"
        stamps.append((name, st.st_size, st.st_mtime_ns, sha))
    if not checksums:
        return None
    key = str(folder.resolve())
    if _verified.get(key) == tuple(stamps):
        return None
    for name, _, _, sha in stamps:
        if _sha256(folder / name) != sha:
            return f"{name} does not match its SHA-256"
    problem = _unloadable(folder, [name for name, *_ in stamps])
    if problem is not None:
        return problem
    _verified[key] = tuple(stamps)
    return None


# What the trainer reads from a checkpoint's top level on resume, by name: JSON, torch.load(weights_only=True)
# (rng_state*.pth, optimizer.pt, scheduler.pt, an adapter or model saved as .bin), safetensors.
# training_args.bin is written but never read back (a pickle of the arguments: not loadable with weights_only).
_NOT_READ_ON_RESUME = {"training_args.bin"}
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# What DeepSpeed writes when the trainer saves (tag global_stepN) and reads back with its own loader.
_DEEPSPEED_SHARD = re.compile(r"^global_step\d+/[^/]+\.pt$")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line[:120]}" if line else type(exc).__name__


def _unloadable(folder: Path, names: list[str]) -> Optional[str]:
    """Why a checkpoint whose checksums match cannot be resumed (None: the trainer can read every file of it).

    Each file is read as the trainer reads it on resume; torch files memory-mapped, so only their pickles
    are parsed (no tensor is read), under transformers' own allowlist for the RNG state's numpy arrays.
    """
    top = [n for n in names if "/" not in n and n not in _NOT_READ_ON_RESUME]
    if TRAINER_STATE_FILE not in top:
        return f"no {TRAINER_STATE_FILE} (the step and data position to resume from)"
    for name in names:
        if _DEEPSPEED_SHARD.match(name):
            problem = _engine_shard_problem(folder / name)
            if problem:
                return f"{name}: {problem}"
    for name in top:
        path = folder / name
        try:
            if name == TRAINER_STATE_FILE:
                problem = _trainer_state_problem(path)
                if problem:
                    return f"{name}: {problem}"
            elif name.endswith(".json"):
                json.loads(path.read_text())
            elif name.endswith(".safetensors"):
                _open_safetensors(path)
            elif name.endswith(_TORCH_SUFFIXES):
                _torch_load(path)
        except Exception as exc:
            # Whatever the reader raises (a refused pickle, a bad header, ...): one line naming the file.
            return f"{name} cannot be read ({_first_line(exc)})"
    return None


def _trainer_state_problem(path: Path) -> Optional[str]:
    from transformers import TrainerState

    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return "not JSON"
    if not isinstance(data, dict) or not isinstance(data.get("global_step"), int):
        return "no global_step"
    try:
        TrainerState(**data)  # what the trainer does with it (TrainerState.load_from_json)
    except TypeError as exc:
        return f"not a trainer state ({_first_line(exc)})"
    callbacks = data.get("stateful_callbacks")
    if callbacks is not None and not isinstance(callbacks, dict):
        return "stateful_callbacks is not a mapping"
    return None


def _engine_shard_problem(path: Path) -> Optional[str]:
    """Why DeepSpeed must not load this shard (its loader runs whatever the pickle names); None: it may."""
    import zipfile

    import torch

    if not zipfile.is_zipfile(path):
        return "not in torch's zip format, so its pickle cannot be checked"
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as exc:
        return f"cannot be read ({_first_line(exc)})"
    # DeepSpeed pickles its own classes (LossScaler, ZeroStageEnum: measured on a ZeRO-3 checkpoint).
    foreign = [name for name in unsafe if not name.startswith("deepspeed.")]
    if foreign:
        return f"its pickle names {foreign[0]}, which DeepSpeed's loader would run (it loads without weights_only)"
    return None


def _open_safetensors(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        list(f.keys())


def _torch_load(path: Path) -> None:
    import torch
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            torch.load(path, map_location="cpu", weights_only=True)  # the legacy format cannot be mapped


def last_complete(folder: Path) -> Optional[Path]:
    """The newest checkpoint under `folder` that verifies; each damaged newer one is skipped with one line
    naming it, why, and what is used instead (the checkpoint found, or a fresh start)."""
    damaged: list[tuple[Path, str]] = []
    found = None
    for path in reversed(listing(folder)):
        problem = verify(path)
        if problem is None:
            found = path
            break
        damaged.append((path, problem))
    instead = (
        f"resuming from {found.name} instead"
        if found
        else "no complete checkpoint left: starting from step 0"
    )
    for path, problem in damaged:
        log.warning("damaged checkpoint %s (%s): %s", path, problem, instead)
    return found


def finalize(staged: Path, final: Path) -> Path:
    """Manifest, fsync, then rename `staged` to `final` (an existing `final` of the same step is replaced)."""
    staged, final = Path(staged), Path(final)
    step = step_of(final)
    write_manifest(staged, step if step is not None else -1)
    if final.exists():
        old = final.with_name(f".replaced-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)
    _fsync_dir(final.parent)
    return final


def rotate(folder: Path, keep: int, protect: Optional[Path] = None) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (and `protect`); delete the rest and every damaged one."""
    deleted = []
    complete = 0
    for path in reversed(listing(folder)):
        if protect is not None and path.resolve() == Path(protect).resolve():
            complete += 1
            continue
        problem = verify(path, checksums=False)
        if problem is None and complete < keep:
            complete += 1
            continue
        log.info("removing %s checkpoint %s", "damaged" if problem else "old", path)
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def clean_staging(folder: Path) -> None:
    """Remove what a crash left mid-save (`.staging`, `.replaced-*`); never a named checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.name == STAGING_DIR or path.name.startswith(".replaced-"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)  # the link itself, never what it points to


def supersede_after(folder: Path, step: int) -> list[Path]:
    """Resuming an earlier checkpoint: rename later ones `superseded-checkpoint-N` so resume=true never picks them.

    They belong to the abandoned continuation; they are kept (not deleted) for the user to inspect or remove.
    """
    moved = []
    for path in listing(folder):
        n = step_of(path)
        if n is not None and n > step:
            target = path.with_name(f"{SUPERSEDED_PREFIX}{path.name}")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
            moved.append(target)
    if moved:
        log.warning(
            "resuming from step %d: %d later checkpoint(s) renamed %s* (delete them when no longer needed)",
            step,
            len(moved),
            SUPERSEDED_PREFIX,
        )
    return moved


def discard_all(folder: Path) -> int:
    """resume=false: remove the previous run's checkpoints so they can never be resumed by mistake."""
    paths = listing(folder)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    clean_staging(folder)
    return len(paths)


# ---------------------------------------------------------------- the `resume` setting


def resume_checkpoint(resume: Union[bool, str], folder: Path) -> Optional[str]:
    """Where training continues from: None (start fresh) or a complete checkpoint folder.

    `folder` is the run's checkpoint folder (RUN_DIR/checkpoints).
    - `resume=true`: the newest checkpoint under `folder` that verifies
      (manifest, sizes, SHA-256); damaged newer ones are logged and skipped.
    - `resume=false`: None.
    - `resume=PATH` (or `resume=checkpoint-N`, looked up under `folder`): that
      checkpoint; refused when it is damaged. One without a manifest (written by another
      tool) is accepted with a warning when it has a trainer_state.json.
    """
    folder = Path(folder)
    if resume is False:
        return None
    if resume is True:
        last = last_complete(folder)
        return str(last) if last else None
    path = Path(resume)
    if not path.is_dir() and (folder / resume).is_dir():
        path = folder / resume
    if not path.is_dir():
        complete = [p.name for p in listing(folder)]
        raise ConfigError(
            f"resume={resume}: no such checkpoint folder"
            + (f" (this run has: {', '.join(complete)})" if complete else "")
        )
    problem = verify(path)
    if problem is not None:
        if (path / MANIFEST).exists() or not (path / TRAINER_STATE_FILE).is_file():
            others = [p for p in reversed(listing(folder)) if p.resolve() != path.resolve()]
            newest = next((p for p in others if verify(p) is None), None)
            instead = (
                f"resume=true resumes from {newest.name}, the newest complete one"
                if newest
                else "no other complete checkpoint: resume=false starts over"
            )
            raise ConfigError(f"resume={resume}: damaged checkpoint ({problem}); {instead}")
        log.warning("resume=%s: no checksums to verify (not written by finetune); using it as is", path)
    return str(path)


def prepare_resume(resume: Union[bool, str], folder: Path) -> Optional[str]:
    """Rank 0, before training: clear a crashed save's leftovers, apply `resume`, return the checkpoint to resume.

    resume=false discards the previous checkpoints (so a later resume=true cannot pick
    one of them); resuming an earlier checkpoint of this run renames the later ones
    `superseded-checkpoint-N` (kept for inspection, never resumed).
    """
    folder = Path(folder)
    check_folder(
        folder, deep=False
    )  # a link among the checkpoints: resuming would read, rotation delete, its target
    clean_staging(folder)
    if resume is False:
        n = discard_all(folder)
        if n:
            log.warning("resume=false: discarded %d checkpoint(s) of the previous run in %s", n, folder)
        return None
    path = resume_checkpoint(resume, folder)
    if path is not None:
        step = step_of(Path(path))
        if step is not None and Path(path).parent.resolve() == folder.resolve():
            supersede_after(folder, step)
    return path


def newest_by_size(folder: Path) -> Optional[Path]:
    """The newest checkpoint whose files all have their recorded sizes (no checksums: a signal's grace
    period is short); what `resume=true` will pick unless a file's content was damaged."""
    for path in reversed(listing(folder)):
        if verify(path, checksums=False) is None:
            return path
    return None
