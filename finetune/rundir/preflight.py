"""Checks before training starts: a clear refusal now instead of a crash hours later.

- outputs: no link or special file finetune did not make where training writes (the checkpoints,
  TensorBoard's folder, the trained adapter or model, metrics.json, the profile), since the trainer
  and the libraries write there in place (`check_outputs`);

- disk: free space where the checkpoints go against the plan's checkpoint size
  times the checkpoints that will exist at once (`train.save_total_limit` kept
  plus the one being written), less the ones already there that rotation frees
  (their space is reused), plus the final adapter or model (counted as one
  checkpoint), plus the merged export when the export stage follows in the same
  command (mode=all);
- user files: the files a setting names for later stages (regression prompts) are regular files of a
  sensible size (`check_user_files`), so a FIFO or /dev/zero is refused before training, not after it;
- resume: `resume=PATH` names a complete checkpoint, and the checkpoints there were trained under these
  settings (`state.check_resume_facts`: a mode=plan under other ones may have rewritten config.yaml);
- host memory: the plan's host RAM (offloaded optimizer or parameters, data
  loading, the per-rank baseline) against this machine's total RAM (a refusal)
  and its available RAM (a warning: other processes hold it now).

- the machine (`check_machine`, where ranks start here): as many CUDA GPUs as the
  plan uses on this node, each with the plan's memory (less `machine.MEMORY_TOLERANCE`),
  running its dtype (bf16: compute capability 8.0 or later). A mismatch exits 2 unless
  `launch.allow_mismatch=true`; more GPUs than planned: the first ones are used.

Each check runs once per launch: the pipeline runs both before it starts the ranks itself and
hands the verdict down (`handoff`, read back by `handed_down`); ranks started any other way
(launch.sh by hand, tmux, SLURM, `python -m finetune.train`) run them on rank 0.

`disk_usage`, `memory` and `read` are parameters so tests can stand in for a full disk,
a small machine or another machine's GPUs.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core import userfiles
from finetune.core.config import Config
from finetune.core.errors import DataError, LaunchError, format_bytes
from finetune.planner import Plan
from finetune.rundir import checkpoints, machine, state

log = logging.getLogger(__name__)

GB = 1e9
# Set by the pipeline for the ranks it starts itself: it ran `check` and `check_machine` for them.
PRECHECKED_ENV = "FINETUNE_PRECHECKED"
MISMATCH_ENV = "FINETUNE_MACHINE_MISMATCH"  # what launch.allow_mismatch=true let through


def _virtual_memory() -> Any:
    import psutil

    return psutil.virtual_memory()


def disk_needed_gb(plan: Plan, keep: int, existing: int, exporting: bool) -> float:
    """Checkpoints written before rotation frees old ones (K + 1 at once, less those already on disk), the
    trained output (counted as one checkpoint: it holds the trained weights, a checkpoint those and the
    optimizer's moments, so this is an upper bound) and, when the export stage follows in the same command
    (mode=all), the merged model it writes (plan.json's `disk_gb.export`)."""
    new = max(1, keep + 1 - existing)
    return plan.disk_checkpoint_gb * (new + 1) + (plan.disk_export_gb if exporting else 0.0)


def check(
    cfg: Config,
    run_dir: Path,
    plan: Plan,
    *,
    disk_usage: Callable[[str], Any] = shutil.disk_usage,
    memory: Callable[[], Any] = _virtual_memory,
    checkpoint_dir: Optional[Path] = None,
) -> None:
    """Raise LaunchError when the run cannot finish on this machine (ConfigError for a bad `resume=PATH`)."""
    run_dir = Path(run_dir)
    check_outputs(cfg, run_dir)
    check_user_files(cfg)
    state.check_resume_facts(cfg, run_dir)
    if isinstance(cfg.resume, str):  # resume=true/false cannot be wrong; a path can
        checkpoints.resume_checkpoint(cfg.resume, rundir.checkpoint_dir(run_dir))
    folder = checkpoint_dir or rundir.checkpoint_dir(run_dir)
    existing = sum(1 for p in checkpoints.listing(folder) if checkpoints.verify(p, checksums=False) is None)
    keep = cfg.train.save_total_limit
    exporting = cfg.mode == "all"
    need = disk_needed_gb(plan, keep, existing, exporting)
    free = disk_usage(str(run_dir)).free / GB
    if need > free:
        size = format_bytes  # units that stay meaningful for small runs (kB, MB), not "0.0 GB"
        raise LaunchError(
            f"disk: {run_dir} has {size(free * GB)} free, the run needs about {size(need * GB)} "
            f"({size(plan.disk_checkpoint_gb * GB)} a checkpoint x {keep} kept (train.save_total_limit) + one "
            "being written + the output"
            + (f" + the merged export, {size(plan.disk_export_gb * GB)}" if exporting else "")
            + "); free space, lower train.save_total_limit, or choose another run_dir"
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


def check_user_files(cfg: Config) -> None:
    """The files later stages read that a setting names (the regression prompts), refused now where they are
    not regular files or too large, rather than after training (`core/userfiles.py`)."""
    if cfg.eval.regression and cfg.eval.regression_prompts:
        key, path = "eval.regression_prompts", cfg.eval.regression_prompts
        size = userfiles.check_regular(path, key, DataError)
        userfiles.check_size(size, userfiles.TEXT_LIMIT, key, path, DataError)


def check_outputs(cfg: Config, run_dir: Path) -> None:
    """Refuse (LaunchError, one line) a link or special file finetune did not make where training writes."""
    rundir.check_folder(rundir.checkpoint_dir(run_dir), deep=False)
    rundir.check_folder(run_dir / rundir.TENSORBOARD_DIR)
    rundir.check_folder(rundir.trained_dir(run_dir, cfg.method.uses_adapters))
    for name in (rundir.METRICS_FILE, rundir.PROFILE_FILE):
        rundir.check_target(run_dir / name)


@dataclass(frozen=True)
class MachineCheck:
    """What `check_machine` found: the environment that limits the ranks to the planned GPUs, and notes."""

    env: dict[str, str]
    notes: tuple[str, ...] = ()
    mismatch: Optional[str] = None  # let through by launch.allow_mismatch=true


def needs_bf16(cfg: Config) -> bool:
    """Does the plan's training run bf16 on CUDA (weights, QLoRA compute, or bf16 adapters)?"""
    m = cfg.method
    return (
        m.dtype_on("cuda") == "bf16"
        or (m.spec.quantized_base and m.compute_dtype == "bf16")
        or (m.uses_adapters and m.adapter_dtype == "bf16")
    )


def check_machine(
    cfg: Config,
    plan: Plan,
    *,
    gpus: int,
    device: str,
    allow_mismatch: bool,
    read: Optional[Callable[[Optional[Path]], machine.Machine]] = None,
) -> MachineCheck:
    """Refuse (LaunchError) to start `plan` on a machine that cannot run it; see the module doc.

    `gpus` and `device`: what this node starts (the launch layout's processes per node); `read` stands
    in for `machine.read_machine` in tests.
    """
    if device != "cuda":
        return MachineCheck({})
    hw = plan.hardware
    req = machine.Requirement(hw.name, device, gpus, hw.gpu_memory_gb, needs_bf16(cfg))
    here = (read or machine.read_machine)(None)
    problem = machine.mismatch(req, here)
    if problem is not None:
        if not allow_mismatch:
            raise LaunchError(problem)
        return MachineCheck({}, (f"launch.allow_mismatch=true: starting anyway although {problem}",), problem)
    if len(here.gpus) <= gpus:
        return MachineCheck({})
    visible = machine.visible_devices(gpus, os.environ)
    return MachineCheck(
        {"CUDA_VISIBLE_DEVICES": visible},
        (f"this machine has {len(here.gpus)} GPUs, the plan uses {gpus}: CUDA_VISIBLE_DEVICES={visible}",),
    )


def handoff(checked: MachineCheck) -> dict[str, str]:
    """The environment that tells the ranks this process starts: the checks ran, and what they let through."""
    return {PRECHECKED_ENV: "1", **({MISMATCH_ENV: checked.mismatch} if checked.mismatch else {})}


def handed_down(environ: Mapping[str, str]) -> Optional[MachineCheck]:
    """The pipeline's verdict when it started this rank after checking (`handoff`); None: check here."""
    if environ.get(PRECHECKED_ENV) != "1":
        return None
    return MachineCheck({}, mismatch=environ.get(MISMATCH_ENV) or None)
