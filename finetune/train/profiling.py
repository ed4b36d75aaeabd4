"""Where a training step's time goes (`train.profile=true`): data, forward, loss, backward, optimizer.

`StepProfiler.attach(trainer)` times the Trainer's own calls, so the split is that of the real run:

- data: `get_batch_samples` (the micro-batches of one optimizer step, collated, and their token count);
- forward: the decoder stack's forward (hooks on the backbone module, e.g. `LlamaModel`);
- loss: the rest of `compute_loss`: the LM head and the loss (the chunked loss makes its gradients here;
  TRL's fused head recomputes its tiles in the backward, which then counts as backward);
- backward: the rest of `training_step` (`accelerator.backward`, with checkpointing's recomputation);
- optimizer: gradient clipping and the optimizer step (`on_pre_optimizer_step`..`on_optimizer_step`);
- other: what is left of the step (scheduler, zero_grad, callbacks). Logging, evaluation and saving
  happen between steps and are not in any step.

Each boundary reads `time.perf_counter()` after `torch.cuda.synchronize()` on CUDA (the GPU's queue
drained, so a phase's time is its kernels'); on the CPU the same code runs without the sync. The first
step (warm-up: allocator, cuBLAS, compilation) and the step run under `torch.profiler` are left out of
the medians. The profiled step (the last) lists the operators by self time (device time on CUDA) in
RUN_DIR/profile_ops.txt and its top rows in the summary, which is how the attention kernel that really
ran is seen (SDPA's flash or memory-efficient kernel, FlexAttention's, flash-attn's).

Under DeepSpeed the optimizer step runs inside `accelerator.backward`, so it counts as backward there.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from finetune import rundir
from finetune.modeling.collator import NUM_TOKENS_KEY

PHASES = ("data", "forward", "loss", "backward", "optimizer", "other")
TOP_OPS = 12
# Operator names that say which attention kernel ran (SDPA's flash / memory-efficient / math kernels,
# FlexAttention's, flash-attn's varlen, cutlass fmha).
ATTENTION_MARKERS = ("attention", "flash", "fmha", "flex")


def _backbone(model: Any) -> Optional[torch.nn.Module]:
    """The decoder stack (e.g. `LlamaModel`) under a causal LM, through a PEFT wrapper."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    backbone = getattr(base, "base_model", None)
    return backbone if isinstance(backbone, torch.nn.Module) and backbone is not base else None


class StepProfiler(TrainerCallback):
    """Per optimizer step: seconds in each phase and tokens; `summary()` for metrics.json."""

    def __init__(self, device: str, out_dir: Optional[Path] = None, operators: bool = True):
        self.sync = device == "cuda" and torch.cuda.is_available()
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.operators = operators
        self.steps: list[dict[str, Any]] = []
        self.profiled_step: Optional[int] = None
        self.top_ops: list[dict[str, Any]] = []
        self.attention_ops: list[dict[str, Any]] = []
        self._trainer: Any = None
        self._current: Optional[dict[str, Any]] = None
        self._torch_profiler: Any = None
        self._backbone_start: Optional[float] = None
        self._backbone_s = 0.0
        self._pre_optimizer: Optional[float] = None
        self._last_backward_end: Optional[float] = None

    def clock(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------ wiring

    def attach(self, trainer: Any) -> StepProfiler:
        """Wrap the trainer's data, loss and step calls, hook the backbone, and join its callbacks."""
        self._trainer = trainer
        trainer.get_batch_samples = self._timed_data(trainer.get_batch_samples)
        trainer.training_step = self._timed_training_step(trainer.training_step)
        trainer.compute_loss = self._timed_compute_loss(trainer.compute_loss)
        backbone = _backbone(trainer.model)
        if backbone is not None:
            backbone.register_forward_pre_hook(self._backbone_begin)
            backbone.register_forward_hook(self._backbone_end)
        trainer.add_callback(self)
        return self

    def _timed_data(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
            state = self._trainer.state
            if (
                self.operators
                and self._torch_profiler is None
                and state.global_step + 1 == state.max_steps > 2
            ):
                self._start_operators(state.global_step + 1)
            start = self.clock()
            out = fn(*args, **kwargs)
            self._current = dict.fromkeys(PHASES, 0.0)
            self._current.update(start=start, tokens=0, data=self.clock() - start)
            return out

        return get_batch_samples

    def _timed_training_step(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if self._current is None:
                return fn(*args, **kwargs)
            before = self._current["forward"] + self._current["loss"]
            start = self.clock()
            out = fn(*args, **kwargs)
            self._last_backward_end = end = self.clock()
            self._current["backward"] += (end - start) - (
                self._current["forward"] + self._current["loss"] - before
            )
            return out

        return training_step

    def _timed_compute_loss(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._current is None or not self._trainer.model.training:  # evaluation: not a training step
                return fn(model, inputs, *args, **kwargs)
            tokens = inputs.get(NUM_TOKENS_KEY)
            self._current["tokens"] += int(tokens) if tokens is not None else 0
            self._backbone_s = 0.0
            start = self.clock()
            out = fn(model, inputs, *args, **kwargs)
            total = self.clock() - start
            self._current["forward"] += self._backbone_s
            self._current["loss"] += total - self._backbone_s
            return out

        return compute_loss

    def _backbone_begin(self, module: Any, args: Any) -> None:
        if self._current is not None and module.training and torch.is_grad_enabled():
            self._backbone_start = self.clock()

    def _backbone_end(self, module: Any, args: Any, output: Any) -> None:
        if self._backbone_start is not None:
            self._backbone_s += self.clock() - self._backbone_start
            self._backbone_start = None

    # ------------------------------------------------------------ the trainer's callbacks

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._pre_optimizer = self.clock()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._current is not None and self._pre_optimizer is not None:
            # gradient clipping and norm (after the last backward) + the optimizer's step
            since = self._last_backward_end or self._pre_optimizer
            self._current["optimizer"] += self.clock() - since

    def on_step_end(self, args, state, control, **kwargs):
        if self._current is None:
            return
        current, self._current = self._current, None
        step_s = self.clock() - current.pop("start")
        current["other"] = max(0.0, step_s - sum(current[p] for p in PHASES if p != "other"))
        current.update(step=state.global_step, step_s=step_s)
        self.steps.append(current)
        self._last_backward_end = self._pre_optimizer = None
        if self._torch_profiler is not None:
            self._stop_operators()

    # ------------------------------------------------------------ one step under torch.profiler

    def _start_operators(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.sync else [])
        self._torch_profiler = profile(activities=activities)
        self._torch_profiler.start()
        self.profiled_step = step

    def _stop_operators(self) -> None:
        prof, self._torch_profiler = self._torch_profiler, None
        prof.stop()
        averages = prof.key_averages()
        key = "self_device_time_total" if self.sync else "self_cpu_time_total"
        rows = sorted(averages, key=lambda e: getattr(e, key), reverse=True)

        def op(e: Any) -> dict[str, Any]:
            return {"name": e.key, "self_ms": round(getattr(e, key) / 1e3, 3), "calls": e.count}

        self.top_ops = [op(e) for e in rows[:TOP_OPS] if getattr(e, key) > 0]
        self.attention_ops = [
            op(e) for e in rows if getattr(e, key) > 0 and any(m in e.key.lower() for m in ATTENTION_MARKERS)
        ]
        if self.out_dir is not None:
            rundir.atomic_write_text(
                self.out_dir / rundir.PROFILE_FILE, averages.table(sort_by=key, row_limit=40) + "\n"
            )

    # ------------------------------------------------------------ results

    def timed_steps(self) -> list[dict[str, Any]]:
        """The steps the medians use: not the first (warm-up), not the one under torch.profiler."""
        kept = [s for s in self.steps[1:] if s["step"] != self.profiled_step]
        return kept or [s for s in self.steps if s["step"] != self.profiled_step] or self.steps

    def summary(self) -> dict[str, Any]:
        timed = self.timed_steps()
        if not timed:
            return {"steps": []}
        median = {p: statistics.median(s[p] for s in timed) for p in (*PHASES, "step_s")}
        seconds = sum(s["step_s"] for s in timed)
        return {
            "synchronized": self.sync,
            "timed_steps": [s["step"] for s in timed],
            "median_s": {k: round(v, 6) for k, v in median.items()},
            "share": {
                p: round(median[p] / median["step_s"], 4) if median["step_s"] else None for p in PHASES
            },
            # The median of the timed steps' rates: steady, without warm-up, the profiler, or a one-off
            # recompilation (torch.compile meeting a new row width) weighing in.
            "tokens_per_second": round(statistics.median(s["tokens"] / s["step_s"] for s in timed), 2)
            if seconds
            else None,
            "profiled_step": self.profiled_step,
            "top_ops": self.top_ops,
            "attention_ops": self.attention_ops,
            "steps": [
                {k: round(v, 6) if isinstance(v, float) else v for k, v in s.items()} for s in self.steps
            ],
        }
