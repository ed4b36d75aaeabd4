"""Watching the run: throughput and peak memory against the plan, early stops, rich progress.

- `RunMonitor`: step time, tokens/s and peak memory (CUDA `max_memory_allocated`,
  or the process's peak RSS on the CPU) logged next to the plan's predicted
  total; a warning when the measurement exceeds the plan.
- `EarlyStop`: stops on a loss spike (a logged loss above `loss_spike_factor`
  times the moving average of the previous ones) and when the eval loss rises
  `eval_rise_patience` evaluations in a row; it saves a checkpoint first.
- `Preemption`: SIGTERM or SIGINT saves a checkpoint at the next step boundary
  and stops (all ranks at the same step); a second signal stops at once.
- `RichProgress`: one progress bar with loss and throughput on the terminal
  (replaces transformers' tqdm bars and printed dicts), redrawn from the loop, at most twice a second.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from typing import Any, Optional

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from finetune.rundir import checkpoints, machine

log = logging.getLogger(__name__)

GB = 1e9


def peak_memory_gb(device: str) -> float:
    """CUDA: the allocator's peak on this rank's GPU. CPU: the process's peak resident set size."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GB
    return machine.peak_rss_bytes() / GB


class RunMonitor(TrainerCallback):
    """Step time, tokens/s and peak memory next to the plan; a warning when memory exceeds it.

    `tokens_seen` is advanced by the trainer (real tokens of each micro-batch). On
    the CPU the peak RSS includes the interpreter and libraries, so the comparison
    with the plan uses the growth over `baseline_gb` (the RSS before the model
    was loaded); on CUDA the allocator's peak is compared as is.
    """

    def __init__(self, device: str, planned_memory_gb: Optional[float], baseline_gb: float = 0.0):
        self.device = device
        self.planned_memory_gb = planned_memory_gb
        self.baseline_gb = baseline_gb if device != "cuda" else 0.0
        self.tokens_seen = 0
        self.warned = False
        self.steps_begun = 0  # by this process: 0 until the first step starts (resuming has loaded all)
        self._t_train = 0.0
        self._t_step = 0.0
        self._tokens_at_start = 0
        self.step_seconds: list[float] = []
        self.train_seconds = 0.0
        # The process's CPU seconds over the same span (every thread): on a shared machine the wall clock
        # measures the other tenants too, the CPU time mostly this process's own work.
        self.train_cpu_seconds = 0.0
        self._cpu_train = 0.0

    # The trainer calls this for every micro-batch with the rows' real lengths. Not the Trainer's
    # include_num_input_tokens_seen="non_padding": it counts ids != pad, and with pad = eos (Llama 3.x) misses every
    # eos, 9.4% of the bundled data's tokens (BENCHMARKS.md), and it all-gathers a count every step.
    def add_tokens(self, n: int) -> None:
        self.tokens_seen += n

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_seen / self.train_seconds if self.train_seconds > 0 else 0.0

    def measured_gb(self) -> float:
        return peak_memory_gb(self.device)

    def compared_gb(self) -> float:
        """What is held against the plan: the peak, less the CPU process's baseline."""
        return max(0.0, self.measured_gb() - self.baseline_gb)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.device == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._t_train = time.perf_counter()
        self._cpu_train = time.process_time()

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps_begun += 1
        self._t_step = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self._t_step)
        self.train_seconds = now - self._t_train
        self.train_cpu_seconds = time.process_time() - self._cpu_train
        if self.planned_memory_gb and not self.warned and self.compared_gb() > self.planned_memory_gb:
            self.warned = True
            log.warning(
                "peak memory %.3f GB exceeds the plan's %.3f GB at step %d (%s)",
                self.compared_gb(),
                self.planned_memory_gb,
                state.global_step,
                "CUDA max_memory_allocated"
                if self.device == "cuda"
                else "RSS growth over the pre-load baseline",
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not self.step_seconds:
            return
        recent = self.step_seconds[-max(1, args.logging_steps) :]
        logs["step_seconds"] = round(sum(recent) / len(recent), 4)
        logs["tokens_per_second"] = round(self.tokens_per_second, 1)
        logs["peak_memory_gb"] = round(self.measured_gb(), 4)
        if self.planned_memory_gb is not None:
            logs["planned_memory_gb"] = round(self.planned_memory_gb, 4)


class EarlyStop(TrainerCallback, ExportableState):
    """Stop (after saving) on a loss spike or on eval loss rising `eval_rise_patience` evaluations in a row.

    Its window of recent losses is saved in every checkpoint (`state`, under
    trainer_state.json's `stateful_callbacks`) and put back on resume (`restore`),
    so a resumed run stops exactly where the uninterrupted one would.

    Not transformers' EarlyStoppingCallback: that one stops only on an eval metric that stops improving, needs
    metric_for_best_model (and warns without load_best_model_at_end), and does not save first.
    """

    def __init__(
        self, loss_spike_factor: float, eval_rise_patience: int, window: int = 10, warmup_logs: int = 3
    ):
        self.loss_spike_factor = loss_spike_factor
        self.eval_rise_patience = eval_rise_patience
        self.window = window
        self.warmup_logs = warmup_logs
        self.losses: deque[float] = deque(maxlen=window)
        self.last_eval: Optional[float] = None
        self.rises = 0
        self.reason: Optional[str] = None

    def state(self) -> dict:
        return {
            "args": {
                "loss_spike_factor": self.loss_spike_factor,
                "eval_rise_patience": self.eval_rise_patience,
                "window": self.window,
                "warmup_logs": self.warmup_logs,
            },
            "attributes": {"losses": list(self.losses), "last_eval": self.last_eval, "rises": self.rises},
        }

    def restore(self, checkpoint: str) -> None:
        """Take back the window of losses saved in `checkpoint`'s trainer_state.json (if there is one)."""
        import json
        from pathlib import Path

        path = Path(checkpoint) / checkpoints.TRAINER_STATE_FILE
        # `checkpoints.verify` checked it is a trainer state; what our callback saved there may still be odd.
        saved = (json.loads(path.read_text()).get("stateful_callbacks") or {}).get(type(self).__name__)
        if isinstance(saved, list):
            saved = saved[-1] if saved else None
        if not isinstance(saved, dict):
            return
        attributes = saved.get("attributes", {})
        if not isinstance(attributes, dict):
            return
        self.losses = deque(attributes.get("losses", ()), maxlen=self.window)
        self.last_eval = attributes.get("last_eval")
        self.rises = int(attributes.get("rises", 0))

    def _stop(self, control, state, reason: str) -> None:
        self.reason = reason
        log.warning("stopping early at step %d: %s (saving a checkpoint first)", state.global_step, reason)
        control.should_save = True
        control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is None or self.loss_spike_factor <= 0:
            return
        if len(self.losses) >= self.warmup_logs:
            average = sum(self.losses) / len(self.losses)
            if loss > self.loss_spike_factor * average or loss != loss:  # NaN counts as a spike
                self._stop(
                    control,
                    state,
                    f"loss spike: {loss:.4f} > {self.loss_spike_factor:g} x moving average {average:.4f}",
                )
                return
        self.losses.append(loss)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None or self.eval_rise_patience <= 0:
            return
        if self.last_eval is not None and loss > self.last_eval:
            self.rises += 1
        else:
            self.rises = 0
        self.last_eval = loss
        if self.rises >= self.eval_rise_patience:
            self._stop(control, state, f"eval loss rose {self.rises} evaluations in a row (now {loss:.4f})")


class Preemption(TrainerCallback):
    """SIGTERM/SIGINT: finish the current optimizer step, save a checkpoint, stop; a later second one stops now.

    Preempted cloud machines, `scancel`, Kubernetes and torchrun all send SIGTERM
    and wait a grace period (torchrun: 30 s) before SIGKILL; a LoRA checkpoint
    takes seconds, a full 70B one may not fit in that window, in which case the
    previous checkpoint stays the resume point (the half-written one is never
    renamed into place). Under several ranks the flag is reduced across them
    every step so all stop at the same step and save together.
    """

    # A repeat within this many seconds is the same request arriving twice (Ctrl-C reaches every process of
    # the terminal's group, and torchrun then sends its workers SIGTERM), not a demand to stop at once.
    repeat_after_s = 5.0

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: Optional[str] = None
        self.received_at = 0.0
        self.stopped_at: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def install(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if time.monotonic() - self.received_at < self.repeat_after_s:
                return
            # A second request: stop now; the complete checkpoints on disk are intact.
            self.uninstall()
            raise KeyboardInterrupt(name)
        self.received, self.received_at = name, time.monotonic()
        # os.write: a print here could re-enter a stream the main thread is writing.
        os.write(
            2,
            f"\nfinetune.train: {name}: saving a checkpoint after this step, then stopping "
            "(send it again to stop at once)\n".encode(),
        )

    def _any_rank(self, args) -> bool:
        import torch.distributed as dist

        flag = self.received is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([1 if flag else 0], device=args.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
            if flag and self.received is None:
                self.received = "SIGTERM (another rank)"
        return flag

    def on_step_end(self, args, state, control, **kwargs):
        if self._any_rank(args):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True


class RichProgress(TrainerCallback):
    """A rich progress bar with the latest loss, eval loss and tokens/s (main process only).

    Redrawn by the training loop itself, at most every `redraw_s` seconds, not by rich's refresh thread (10 a
    second): that thread took the GIL from the step and, on a loaded 2-core machine, 43-59 ms of CPU a DPO step
    (BENCHMARKS.md, "Framework overhead per step (CPU)").
    """

    redraw_s = 0.5

    def __init__(self, monitor: Optional[RunMonitor] = None):
        self.monitor = monitor
        self.progress: Any = None
        self.task: Any = None
        self.loss = "-"
        self.eval_loss = "-"
        self._drawn_at = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  eval {task.fields[eval_loss]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
            auto_refresh=False,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            "train", total=state.max_steps, completed=state.global_step, loss="-", eval_loss="-", tps="-"
        )
        self._refresh(state, force=True)

    def _refresh(self, state, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if not force and now - self._drawn_at < self.redraw_s:
            return
        self._drawn_at = now
        tps = f"{self.monitor.tokens_per_second:,.0f}" if self.monitor else "-"
        self.progress.update(
            self.task,
            completed=state.global_step,
            loss=self.loss,
            eval_loss=self.eval_loss,
            tps=tps,
            refresh=True,
        )

    def on_step_end(self, args, state, control, **kwargs):
        self._refresh(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" in logs:
            self.loss = f"{logs['loss']:.4f}"
        if "eval_loss" in logs:
            self.eval_loss = f"{logs['eval_loss']:.4f}"
        self._refresh(state, force=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self._refresh(state, force=True)
            self.progress.stop()
            self.progress = None


# ---------------------------------------------------------------- the last step is the last step


def schedule_target(trainer: Any) -> int:
    """The optimizer steps the schedule runs: train.max_steps, or the trainer's own count by epochs."""
    args = trainer.args
    if args.max_steps > 0:
        return int(args.max_steps)
    return int(trainer.set_initial_training_values(args, trainer.get_train_dataloader())[-1])


def finish_from_final_checkpoint(trainer: Any, checkpoint: Optional[str]) -> bool:
    """Where `checkpoint` already holds the schedule's last step (a stop came after it was saved, before the
    output was), load it into the model and the trainer's state without training; True when it did.

    transformers resumed there would train one step past the schedule before it checks the step count, and
    the output would then differ from the uninterrupted run's. Loading the checkpoint's weights instead gives
    that run's output bit for bit (the final output is saved from the same weights). Engines that load a
    checkpoint only once the model is wrapped (DeepSpeed, FSDP) are left to the trainer, whose loop then
    fetches no batch past the schedule (`past_the_schedule`): False.
    """
    import json
    from pathlib import Path

    from transformers import TrainerState

    if not checkpoint or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return False
    state_file = Path(checkpoint) / checkpoints.TRAINER_STATE_FILE
    step = json.loads(state_file.read_text()).get("global_step", 0)
    if step < schedule_target(trainer):
        return False
    log.info(
        "%s holds the schedule's last step (%d): its weights are the output; nothing to train",
        checkpoint,
        step,
    )
    trainer._load_from_checkpoint(checkpoint)
    trainer.state = TrainerState.load_from_json(str(state_file))
    return True


def past_the_schedule(trainer: Any) -> bool:
    """Whether the trainer, about to fetch the batches of a step, already stands at its schedule's last step;
    then the loop is told to stop and the step is never taken. transformers checks the step count only after
    a step, so a run resumed from its final checkpoint (DeepSpeed and FSDP load it inside the loop, once the
    model is wrapped) would otherwise train one step past max_steps and save another adapter."""
    state = trainer.state
    if 0 < state.max_steps <= state.global_step:
        trainer.control.should_training_stop = True
        return True
    return False
