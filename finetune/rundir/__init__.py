"""The run directory: every stage reads what the previous one wrote here. This package is its API.

- `layout`: every file and folder name, once;
- `files`: atomic, secret-scrubbed writes (a crash never leaves a half-written file), never through a
  link or special file finetune did not make (`check_target`, `check_folder`);
- `ownership`: a run directory is the project's own, and nothing the project did not write is deleted;
- `lock`: one writer per run directory, handed down to the training processes;
- `state`: the resolved config, plan and engine record read back by later stages and ranks, and the
  resume policy (a config is never written over checkpoints trained under another one);
- `shell`: lines of the generated scripts;
- `checkpoints`, `preflight`, `machine`: staged and checksummed checkpoints, the pre-checks run once per
  launch, and this machine against the plan.

`prepare` creates (or reuses one of ours), checks, locks and marks a run directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune.core.config import Config
from finetune.core.errors import LaunchError
from finetune.rundir.files import (
    SHELL_SUFFIXES,
    atomic_write_bytes,
    atomic_write_text,
    check_folder,
    check_target,
    free_bytes,
    make_fresh_folder,
    read_own_text,
    write_json,
)
from finetune.rundir.layout import (
    ACCELERATE_FILE,
    ACCELERATE_FSDP_FILE,
    ADAPTER_DIR,
    CHECKPOINT_DIR,
    COMPARE_DIR,
    COMPARE_JSON_FILE,
    COMPARE_MD_FILE,
    CONFIG_FILE,
    DATA_DIR,
    DATA_EVAL_DIR,
    DATA_HISTOGRAM_FILE,
    DATA_STATS_FILE,
    DATA_TRAIN_DIR,
    DEEPSPEED_FILE,
    ENGINE_FILE,
    EVAL_CURVES_FILE,
    EVAL_DIR,
    EVAL_METRICS_FILE,
    EVAL_REPORT_FILE,
    EVAL_SAMPLES_FILE,
    EXPORT_ADAPTER_DIR,
    EXPORT_DIR,
    EXPORT_SUMMARY_FILE,
    IDENTITY_FILE,
    LAUNCH_LOG,
    LAUNCH_PID_FILE,
    LAUNCH_SCRIPT,
    LOCK_FDS_ENV,
    LOCK_FILE,
    MERGE_CHECK_FILE,
    MERGED_DIR,
    METRICS_FILE,
    MODEL_DIR,
    OWNER_FILE,
    PLAN_FILE,
    PROFILE_FILE,
    RESUME_FILE,
    ROLLOUT_FILE,
    SBATCH_FILE,
    SERVE_FILE,
    SMOKE_DIR,
    SMOKE_REPORT_FILE,
    TENSORBOARD_DIR,
    TRAIN_LOG_FILE,
    VLLM_SERVER_LOG,
    checkpoint_dir,
    eval_dir,
    export_dir,
    merged_dir,
    trained_dir,
)
from finetune.rundir.lock import held_fds, lock
from finetune.rundir.ownership import check_replaceable, check_run_dir, is_owned, mark_owned, replace_tree
from finetune.rundir.shell import command_line, export_line, references_secrets, shell_comment
from finetune.rundir.state import (
    check_resumable,
    load_config,
    load_engine,
    load_plan,
    load_rollout,
    save_config,
)


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


__all__ = [
    "ACCELERATE_FILE",
    "ACCELERATE_FSDP_FILE",
    "ADAPTER_DIR",
    "CHECKPOINT_DIR",
    "COMPARE_DIR",
    "COMPARE_JSON_FILE",
    "COMPARE_MD_FILE",
    "CONFIG_FILE",
    "DATA_DIR",
    "DATA_EVAL_DIR",
    "DATA_HISTOGRAM_FILE",
    "DATA_STATS_FILE",
    "DATA_TRAIN_DIR",
    "DEEPSPEED_FILE",
    "ENGINE_FILE",
    "EVAL_CURVES_FILE",
    "EVAL_DIR",
    "EVAL_METRICS_FILE",
    "EVAL_REPORT_FILE",
    "EVAL_SAMPLES_FILE",
    "EXPORT_ADAPTER_DIR",
    "EXPORT_DIR",
    "EXPORT_SUMMARY_FILE",
    "IDENTITY_FILE",
    "LAUNCH_LOG",
    "LAUNCH_PID_FILE",
    "LAUNCH_SCRIPT",
    "LOCK_FDS_ENV",
    "LOCK_FILE",
    "MERGED_DIR",
    "MERGE_CHECK_FILE",
    "METRICS_FILE",
    "MODEL_DIR",
    "OWNER_FILE",
    "PLAN_FILE",
    "RESUME_FILE",
    "ROLLOUT_FILE",
    "PROFILE_FILE",
    "SBATCH_FILE",
    "SERVE_FILE",
    "SHELL_SUFFIXES",
    "SMOKE_DIR",
    "SMOKE_REPORT_FILE",
    "TENSORBOARD_DIR",
    "TRAIN_LOG_FILE",
    "VLLM_SERVER_LOG",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_folder",
    "check_replaceable",
    "check_resumable",
    "check_run_dir",
    "check_target",
    "checkpoint_dir",
    "command_line",
    "eval_dir",
    "export_dir",
    "export_line",
    "free_bytes",
    "held_fds",
    "is_owned",
    "load_config",
    "load_engine",
    "load_rollout",
    "load_plan",
    "lock",
    "make_fresh_folder",
    "mark_owned",
    "merged_dir",
    "prepare",
    "read_own_text",
    "references_secrets",
    "replace_tree",
    "save_config",
    "shell_comment",
    "trained_dir",
    "write_json",
]
