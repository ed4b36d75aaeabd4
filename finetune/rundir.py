"""The run directory: every stage reads what the previous one wrote here.

Files are written atomically (temporary file, flush, fsync, rename), so a
crash never leaves a half-written `config.yaml` or `plan.json` behind, and
scrubbed of secrets (`finetune.secrets`). `lock` makes one process the run
directory's only writer: `prepare` takes it, and it is held until the process
ends (the kernel drops an flock even on SIGKILL, so no stale lock survives a
crash). The lock is handed down: the training process the pipeline launches
inherits the lock's file descriptor (`held_fds`, FINETUNE_LOCK_FDS) and so holds
the lock itself, also after its parent died, until it exits; a second run never
starts while any writer lives.

A run directory is the project's own: `prepare` refuses `/`, a home directory,
the installed package and any existing non-empty folder without the ownership
marker (`OWNER_FILE`), which it writes into the folders it creates. Nothing
the project did not write is deleted (`replace_tree`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from finetune import checkpoints
from finetune.config import Config
from finetune.errors import ConfigError, DiskFullError, LaunchError, is_disk_full
from finetune.planner import Plan
from finetune.secrets import scrub, scrub_text, shell_reference, shell_word

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- the layout: every name, once
# What each stage writes into RUN_DIR (README "runs/tiny/"). Every module names these files and folders
# through the constants below (and the helpers after them), never by a string of its own.

CONFIG_FILE = "config.yaml"  # the resolved config every stage and rank reads
PLAN_FILE = "plan.json"  # the plan (DESIGN.md's contract), written by the plan stage
DATA_DIR = "data"  # the data stage's prepared rows: data/train (packed), data/eval (one sample a row)
DATA_TRAIN_DIR = "train"
DATA_EVAL_DIR = "eval"
DATA_STATS_FILE = "data_stats.json"
DATA_HISTOGRAM_FILE = "data_tokens.png"
METRICS_FILE = "metrics.json"  # training's metrics and its in-worker base-vs-trained evaluation
ADAPTER_DIR = "adapter"  # the trained adapter (LoRA, QLoRA) with the tokenizer
MODEL_DIR = "model"  # the trained model (full fine-tuning) with the tokenizer
CHECKPOINT_DIR = "checkpoints"  # resumable checkpoints (finetune.checkpoints)
TENSORBOARD_DIR = "tensorboard"
TRAIN_LOG_FILE = "train_log.jsonl"  # logged dicts a line, read by the loss curves when present
PROFILE_FILE = "profile_ops.txt"  # train.profile: one step's operators
EVAL_DIR = "eval"  # the evaluation stage: eval/metrics.json, samples.jsonl, report.md, loss_curves.png
EVAL_METRICS_FILE = "metrics.json"
EVAL_SAMPLES_FILE = "samples.jsonl"
EVAL_REPORT_FILE = "report.md"
EVAL_CURVES_FILE = "loss_curves.png"
EXPORT_DIR = "export"  # the export stage: export/merged, export/adapter, merge_check.json, serve.sh
MERGED_DIR = "merged"
EXPORT_ADAPTER_DIR = "adapter"
MERGE_CHECK_FILE = "merge_check.json"
SERVE_FILE = "serve.sh"
EXPORT_SUMMARY_FILE = "export.json"
LAUNCH_SCRIPT = "launch.sh"  # mode=launch: the command that starts the ranks
LAUNCH_LOG = "launch.log"  # launch.detach=true: the detached run's output
LAUNCH_PID_FILE = "launch.pid"  # launch.detach=true under nohup
SBATCH_FILE = "slurm.sbatch"
DEEPSPEED_FILE = "deepspeed.json"  # the engine settings the launcher writes for the ranks
ACCELERATE_FSDP_FILE = "accelerate_fsdp.yaml"
ACCELERATE_FILE = "accelerate.yaml"  # launcher=accelerate with a DDP or ZeRO-3 plan
ENGINE_FILE = "engine.json"  # the engine, world size, files and SFTConfig arguments: what each rank reads
SMOKE_DIR = "smoke"  # smoke=true: the sibling's run directory, inside the real one
SMOKE_REPORT_FILE = "smoke_report.json"
COMPARE_DIR = "compare"  # mode=compare without run_dir: runs/compare
COMPARE_JSON_FILE = "compare.json"
COMPARE_MD_FILE = "compare.md"
LOCK_FILE = ".lock"
# Written into every folder finetune creates as a run directory (and into RUN_DIR/data): what holds it is ours
# to replace; a folder without it is the user's and is never written over or deleted.
OWNER_FILE = ".finetune-run"


def trained_dir(run_dir: Path, uses_adapters: bool) -> Path:
    """Where training saves its output: RUN_DIR/adapter (LoRA, QLoRA) or RUN_DIR/model (full fine-tuning)."""
    return Path(run_dir) / (ADAPTER_DIR if uses_adapters else MODEL_DIR)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def eval_dir(run_dir: Path) -> Path:
    return Path(run_dir) / EVAL_DIR


def export_dir(run_dir: Path) -> Path:
    return Path(run_dir) / EXPORT_DIR


def merged_dir(run_dir: Path) -> Path:
    """The merged model export writes: RUN_DIR/export/merged."""
    return export_dir(run_dir) / MERGED_DIR


LOCK_FDS_ENV = "FINETUNE_LOCK_FDS"
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


def shell_comment(text: str) -> str:
    """`text` as one `# ...` line of a script: a newline or other control character in a name or path
    would otherwise end the comment and start a command."""
    return "# " + re.sub(r"[\x00-\x1f\x7f]", "?", str(text))


def export_line(key: str, value: str) -> str:
    """`export KEY=VALUE` for a script: a secret as a `${NAME}` reference (`secrets.shell_reference`), never
    its value; anything else quoted as one literal word."""
    ref = shell_reference(key, value)
    return f"export {key}=${{{ref}}}" if ref else f"export {key}={shell_word(value)}"


def references_secrets(env: dict[str, str]) -> bool:
    """Whether `export_line` writes a secret reference for any of `env` (the script is then mode 0700)."""
    return any(shell_reference(k, v) or shell_word(v).startswith('"') for k, v in env.items())


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(scrub(obj), indent=2, sort_keys=False) + "\n")


def prepare(cfg: Config) -> Path:
    """Create the run directory (or reuse one of ours), check it is writable, lock it, mark it ours."""
    run_dir = cfg.resolved_run_dir
    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"run_dir={run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise LaunchError(f"run_dir={run_dir}: not writable")
    lock(run_dir)
    check_run_dir(run_dir)  # again under the lock: nobody filled it in between
    mark_owned(run_dir)
    return run_dir


# ---------------------------------------------------------------- a run directory is the project's own


def _home_dirs() -> set[Path]:
    homes = {Path.home().resolve()}
    try:
        import pwd

        homes |= {Path(p.pw_dir).resolve() for p in pwd.getpwall() if p.pw_dir not in ("", "/")}
    except (ImportError, OSError, KeyError):  # not POSIX, or no passwd database
        pass
    return homes


def _package_dir() -> Path:
    return Path(__file__).resolve().parent  # the installed finetune package


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


# ---------------------------------------------------------------- one writer per run directory

# Resolved run dir -> the open lock file's descriptor (kept for the process lifetime).
_held: dict[str, int] = {}


def _holders(path: Path) -> list[tuple[int, str]]:
    """(pid, host) of every process that held the lock, one line each: the taker, then who inherited it."""
    try:
        lines = path.read_text().splitlines()
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
        st = os.stat(path)
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
        before = "".join(f"{p} {h}\n" for p, h in _holders(path))
        os.ftruncate(inherited, 0)
        os.pwrite(inherited, (before + me).encode(), 0)
        _held[key] = inherited
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        here = socket.gethostname()
        holders = _holders(path)
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

    path = Path(run_dir) / CONFIG_FILE
    if cfg.resume is False or not path.is_file() or not checkpoints.listing(checkpoint_dir(run_dir)):
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


def load_plan(run_dir: Path) -> Plan:
    """`plan.json` back into a `Plan`, with its hardware profile and process layout (workers read it;
    they never re-plan)."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise LaunchError(
            f"{path}: missing; run the plan stage (python -m finetune mode=plan run_dir={run_dir}) first"
        )
    return Plan.from_dict(json.loads(path.read_text()))


def load_engine(run_dir: Path) -> dict[str, Any]:
    """`engine.json`: the engine, world size, engine files and SFTConfig arguments the launcher wrote."""
    path = Path(run_dir) / ENGINE_FILE
    if not path.is_file():
        raise LaunchError(
            f"{path}: missing; the launcher writes it: train with python -m finetune mode=train run_dir={run_dir} "
            "(or mode=launch; launch.dry_run=true writes it without starting)"
        )
    return json.loads(path.read_text())


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
