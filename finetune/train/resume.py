"""Stopping and resuming a training run: where to resume, whether the run is already complete, and the
one line a stop leaves.

SIGTERM/SIGINT during training saves a checkpoint at the next step and exits 75 (`Preempted`); outside the
loop (loading, saving) it stops at once and says where the run stands (`interrupted_message`). Re-running
resumes from the newest complete checkpoint (`finetune.rundir.checkpoints`); a run whose last checkpoint
ends its schedule is not trained again (`already_trained`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import INTERRUPTED_EXIT_CODE, ConfigError, FinetuneError
from finetune.rundir import checkpoints

log = logging.getLogger(__name__)

# A run stopped by SIGTERM/SIGINT after saving its checkpoint exits with this (EX_TEMPFAIL,
# "try again later"); running the same command again resumes.
PREEMPTED_EXIT_CODE = INTERRUPTED_EXIT_CODE


def read_metrics(run_dir: Path) -> dict:
    """metrics.json as written, or {} when it is missing or damaged (it is rewritten whole at the end)."""
    path = run_dir / rundir.METRICS_FILE
    try:
        doc = json.loads(rundir.read_own_text(path)) if path.is_file() else {}
    except (OSError, ValueError):
        log.warning("%s is damaged (not JSON); it is written anew at the end of this run", path)
        return {}
    return doc if isinstance(doc, dict) else {}


def agreed_resume_point(trainer: Any, cfg: Config, run_dir: Path, rank0: bool) -> tuple[Optional[str], bool]:
    """Rank 0 tidies the checkpoint folder and picks the resume point; every rank gets the same answer.

    Also whether that checkpoint ends a run already complete (`_complete`): there is nothing to train.
    """
    from accelerate.utils import broadcast_object_list

    answer: list[Any] = [None, None, False]
    if rank0:
        try:
            answer[0] = checkpoints.prepare_resume(cfg.resume, rundir.checkpoint_dir(run_dir))
            answer[2] = answer[0] is not None and _complete(trainer, Path(answer[0]), run_dir)
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            answer[1] = exc
    if trainer.accelerator.num_processes > 1:
        broadcast_object_list(answer, from_process=0)
    if answer[1] is not None:
        raise answer[1]
    return answer[0], bool(answer[2])


def _complete(trainer: Any, checkpoint: Path, run_dir: Path) -> bool:
    """`checkpoint` is the last step of this run's schedule, and the run's output and metrics are written.

    transformers resumed from the final step trains one step beyond the schedule before it checks
    the step count (and rewrites the output): re-running a finished job's command must not.
    """
    state = json.loads((checkpoint / checkpoints.TRAINER_STATE_FILE).read_text())
    args = trainer.args
    if args.max_steps > 0:
        target = args.max_steps
    else:  # epoch-based: the trainer's own count of optimizer steps
        target = trainer.set_initial_training_values(args, trainer.get_train_dataloader())[-1]
    previous = read_metrics(run_dir).get("train")
    previous = previous if isinstance(previous, dict) else {}
    return (
        state.get("global_step", 0) >= target
        and previous.get("steps") == state.get("global_step")
        and Path(previous.get("output_dir", "")).is_dir()
    )


def already_trained(run_dir: Path, checkpoint: Optional[str], rank0: bool) -> dict:
    """The metrics of the finished run, marked as such: nothing is trained, saved or evaluated again."""
    path = run_dir / rundir.METRICS_FILE
    metrics = read_metrics(run_dir)
    log.info("already trained: %s is the schedule's last step; nothing to train", checkpoint)
    resumed = str(Path(checkpoint).resolve()) if checkpoint else None
    metrics["train"] = {**metrics["train"], "resumed_from": resumed, "already_complete": True}
    if rank0:
        rundir.write_json(path, metrics)
    return metrics


class Preempted(FinetuneError):
    """Training stopped on SIGTERM/SIGINT after saving a checkpoint: exit code 75 (EX_TEMPFAIL), not 2.

    A FinetuneError so both entry points print its one line and exit with `exit_code`.
    """

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(
        self,
        signal_name: str,
        step: int,
        checkpoint: Optional[Path],
        run_dir: Path,
        resume_point: Optional[Path] = None,
    ):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        if checkpoint:  # saved by this attempt
            where = f"checkpoint saved: {checkpoint}"
        elif resume_point:
            where = f"nothing new saved; the resume point is still {resume_point}"
        else:
            where = "nothing trained yet, nothing saved"
        super().__init__(
            f"stopped by {signal_name} at step {step}; {where}. To resume, run the same command again "
            f"(or: {rundir.command_line('python', '-m', 'finetune.train', run_dir)}); resume=false starts over"
        )


def unresumable(checkpoint: Path, exc: BaseException) -> ConfigError:
    """The one line for a checkpoint that verified but failed to load before the first step: which one, the
    error, and what to resume from instead (the previous complete checkpoint, or a fresh start)."""
    step = checkpoints.step_of(checkpoint)
    earlier = [
        p
        for p in reversed(checkpoints.listing(checkpoint.parent))
        if step is None or (checkpoints.step_of(p) or 0) < step
    ]
    previous = next((p for p in earlier if checkpoints.verify(p) is None), None)
    instead = (
        f"resume={previous.name} resumes from the previous complete checkpoint"
        if previous
        else "resume=false starts over (no earlier complete checkpoint)"
    )
    text = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__
    return ConfigError(
        f"checkpoint {checkpoint} could not be resumed ({error}), before its first step; {instead}"
    )


def interrupted_message(signal_name: str, run_dir: Union[str, Path], during: str = "starting") -> str:
    """The one true line for a worker stopped at once by a signal (outside the training loop's save), `during`
    what it was doing (the `during` of the KeyboardInterrupt `stage.run` passes on)."""
    last = checkpoints.newest_by_size(rundir.checkpoint_dir(Path(run_dir)))
    where = (
        f"the newest complete checkpoint is {last}"
        if last
        else "no checkpoint was saved yet, so the next run starts from the beginning"
    )
    return (
        f"stopped by {signal_name} during {during}, at once (nothing was saved by this stop); {where}. "
        f"To resume, run the same command again (or: {rundir.command_line('python', '-m', 'finetune.train', run_dir)})"
    )
