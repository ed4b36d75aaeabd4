"""Checks before training starts: a clear refusal now instead of a crash hours later.

- disk: free space where the checkpoints go against the plan's checkpoint size
  times the checkpoints that will exist at once (`train.save_total_limit` kept
  plus the one being written), less the ones already there that rotation frees
  (their space is reused), plus the final adapter or model;
- resume: `resume=PATH` names a complete checkpoint;
- host memory: the plan's host RAM (offloaded optimizer or parameters, data
  loading, the per-rank baseline) against this machine's total RAM (a refusal)
  and its available RAM (a warning: other processes hold it now).

`disk_usage` and `memory` are parameters so tests can stand in for a full disk
or a small machine.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from finetune import checkpoints
from finetune.config import Config
from finetune.errors import LaunchError, format_bytes

log = logging.getLogger(__name__)

GB = 1e9


def _virtual_memory() -> Any:
    import psutil

    return psutil.virtual_memory()


def disk_needed_gb(plan: Any, keep: int, existing: int) -> float:
    """Checkpoints written before rotation frees old ones (K + 1 at once, less those already on disk) + the output."""
    new = max(1, keep + 1 - existing)
    return plan.disk_checkpoint_gb * new + plan.disk_checkpoint_gb


def check(
    cfg: Config,
    run_dir: Path,
    plan: Any,
    *,
    disk_usage: Callable[[str], Any] = shutil.disk_usage,
    memory: Callable[[], Any] = _virtual_memory,
    checkpoint_dir: Optional[Path] = None,
) -> None:
    """Raise LaunchError when the run cannot finish on this machine (ConfigError for a bad `resume=PATH`)."""
    run_dir = Path(run_dir)
    if isinstance(cfg.resume, str):  # resume=true/false cannot be wrong; a path can
        from finetune.train.stage import resume_checkpoint

        resume_checkpoint(cfg, run_dir)
    folder = checkpoint_dir or run_dir / "checkpoints"
    existing = sum(1 for p in checkpoints.listing(folder) if checkpoints.verify(p, checksums=False) is None)
    keep = cfg.train.save_total_limit
    need = disk_needed_gb(plan, keep, existing)
    free = disk_usage(str(run_dir)).free / GB
    if need > free:
        size = format_bytes  # units that stay meaningful for small runs (kB, MB), not "0.0 GB"
        raise LaunchError(
            f"disk: {run_dir} has {size(free * GB)} free, the run needs about {size(need * GB)} "
            f"({size(plan.disk_checkpoint_gb * GB)} a checkpoint x {keep} kept (train.save_total_limit) + one "
            "being written + the output); free space, lower train.save_total_limit, or choose another run_dir"
        )
    vm = memory()
    host_need = float(plan.host_memory_gb or 0.0)
    total, available = vm.total / GB, vm.available / GB
    if host_need > total:
        raise LaunchError(
            f"host memory: the plan needs {host_need:,.1f} GB of RAM, this machine has {total:,.1f} GB; "
            "use a larger machine, or a plan without CPU offload (see plan.json: host_memory_gb)"
        )
    if host_need > available:
        log.warning(
            "host memory: the plan needs %.1f GB of RAM, %.1f GB is available now (other processes hold the rest)",
            host_need,
            available,
        )
