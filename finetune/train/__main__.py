"""Per-rank training worker: what the launcher runs on each process.

    python -m finetune.train RUN_DIR
    torchrun --nproc_per_node=8 -m finetune.train RUN_DIR

Reads the resolved `config.yaml` and `plan.json` from RUN_DIR (written by
`python -m finetune`), trains, and writes RUN_DIR/metrics.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from finetune.core.errors import (
    INTERRUPTED_EXIT_CODE,
    WRITE_FAILED,
    DiskFullError,
    FinetuneError,
    interrupt_on_signals,
    is_disk_full,
)
from finetune.core.markup import terminal_line
from finetune.core.noise import quiet_libraries
from finetune.rundir import CONFIG_FILE, PLAN_FILE, checkpoint_dir, free_bytes


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m finetune.train RUN_DIR", file=sys.stderr)
        return 2
    # From the first line on a signal stops the worker (exit 75): at once while it loads or saves,
    # at the next step boundary with a checkpoint while it trains (the trainer's own handler).
    restore = interrupt_on_signals()
    quiet_libraries(_verbose(Path(args[0])))  # before the libraries load: some speak on import
    try:
        from finetune.train.stage import run_worker

        run_worker(args[0])
    except FinetuneError as exc:
        print(f"finetune.train: {terminal_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Interrupted, or the trainer's second signal
        from finetune.train.resume import interrupted_message

        name = getattr(exc, "signal_name", None) or (str(exc.args[0]) if exc.args else "SIGINT")
        during = getattr(exc, "during", "starting")  # what `stage.run` was doing
        print(f"finetune.train: {interrupted_message(name, args[0], during)}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except SystemExit as exc:  # sys.exit from library or user code inside training: never a success
        print(
            f"finetune.train: training was ended by sys.exit({exc.code!r}) from inside it, before it finished; "
            "nothing after the last checkpoint was saved",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:  # OSError, torch's RuntimeError, safetensors' SafetensorError (no OSError)
        full = disk_full(exc, args[0])
        if full is None:
            raise
        print(f"finetune.train: {terminal_line(full)}", file=sys.stderr)
        return full.exit_code
    finally:
        restore()
    return 0


def _verbose(run_dir: Path) -> bool:
    """config.yaml's `verbose`, read before the heavy imports (False where it cannot be read: the worker
    reports a missing or damaged config.yaml itself)."""
    import yaml

    try:
        doc = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(doc, dict) and doc.get("verbose") is True


def disk_full(exc: BaseException, run_dir: str) -> DiskFullError | None:
    """A DiskFullError for a failed write when the disk holding `run_dir` lacks the space a checkpoint needs
    (plan.json's size); None when this failure is something else."""
    write_failed = isinstance(exc, RuntimeError) and any(s in str(exc) for s in WRITE_FAILED)
    if not is_disk_full(exc) and not write_failed:
        return None
    folder = checkpoint_dir(Path(run_dir))
    needed = None
    try:
        plan = json.loads((Path(run_dir) / PLAN_FILE).read_text())
        needed = int(float(plan["disk_gb"]["checkpoint"]) * 1e9)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    free = free_bytes(folder)
    if not is_disk_full(exc) and (free is None or needed is None or free >= needed):
        return None  # a C++ write error with room to spare: not a full disk, show it as it is
    return DiskFullError(getattr(exc, "filename", None) or folder, needed, free)


if __name__ == "__main__":
    raise SystemExit(main())
