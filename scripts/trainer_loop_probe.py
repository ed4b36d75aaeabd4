"""Run a Trainer script or module with the same probe of its training loop, for scripts/bench_dpo_overhead.py.

    python scripts/trainer_loop_probe.py OUT.json [--off PART,...] -m finetune.train RUN_DIR
    python scripts/trainer_loop_probe.py OUT.json plain_trl_dpo.py RUN_DIR STEPS PLAIN.json

One probe for both sides, so neither is timed by its own code: transformers' `CallbackHandler` (every
Trainer's) is wrapped to read, from the first step's start to the last step's end, the wall clock, the
process's user and system CPU seconds, its minor page faults, the seconds spent in Python's garbage
collector, the time inside the callbacks' `on_step_end` and each thread's CPU, and the torch state
(threads) at the loop's start. `--off` switches a part of finetune's worker off (`PARTS`), to find what
a step's extra time belongs to; nothing is switched off by default.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import resource
import runpy
import sys
import time
from typing import Any


def _no_tensorboard() -> None:
    import finetune.train.base_trainer as base

    base.run_callbacks = lambda cfg, run_dir, args, callbacks: list(callbacks)


def _no_callbacks() -> None:
    import finetune.train.base_trainer as base

    base.run_callbacks = lambda cfg, run_dir, args, callbacks: []


def _no_token_count() -> None:
    from trl import DPOTrainer

    import finetune.train.dpo_trainer as dpo

    dpo.FinetuneDPOTrainer.compute_loss = DPOTrainer.compute_loss  # type: ignore[method-assign]


# What `--off` can switch off in finetune's worker: TensorBoard's callback, all of finetune's callbacks, the
# token count in compute_loss.
PARTS = {
    "tensorboard": _no_tensorboard,
    "callbacks": _no_callbacks,
    "token_count": _no_token_count,
}


def _usage() -> tuple[float, ...]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), ru.ru_utime, ru.ru_stime, float(ru.ru_minflt)


# glibc's struct mallinfo2, in order (size_t fields).
_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
              "keepcost")  # fmt: skip


def _heap() -> dict[str, int]:
    """glibc's heap at this moment (mallinfo2: bytes in the main heap, free in it, in mmapped chunks and how many),
    or {} where the C library has no mallinfo2 (not glibc, glibc < 2.33)."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = Info
    info = fn()
    return {name: int(getattr(info, name)) for name in _MALLINFO2}


def _thread_cpu() -> dict[str, float]:
    """Each thread's CPU seconds (user + system), by thread id and name."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        found[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / ticks
    return found


class Probe:
    def __init__(self) -> None:
        self.in_loop = False
        self.steps = 0
        self.gc_seconds = 0.0
        self.gc_collections = 0
        self.step_end_seconds = 0.0
        self._gc_start = 0.0
        self.start: tuple[float, ...] = ()
        self.end: tuple[float, ...] = ()
        self.threads_start: dict[str, float] = {}
        self.threads_end: dict[str, float] = {}
        self.state: dict[str, Any] = {}

    def on_gc(self, phase: str, info: dict) -> None:
        if not self.in_loop:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_collections += 1
            self.gc_seconds += time.perf_counter() - self._gc_start

    def install(self) -> None:
        from transformers.trainer_callback import CallbackHandler

        gc.callbacks.append(self.on_gc)
        begin, step_end = CallbackHandler.on_train_begin, CallbackHandler.on_step_end
        probe = self

        def on_train_begin(handler: Any, args: Any, state: Any, control: Any) -> Any:
            result = begin(handler, args, state, control)
            import torch

            probe.state = {
                "threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads(),
                "callbacks": [type(c).__name__ for c in handler.callbacks],
                "gc_objects": len(gc.get_objects()),
                "modules": len(sys.modules),
                "heap": _heap(),
            }
            probe.threads_start = _thread_cpu()
            probe.start = _usage()
            probe.in_loop = True
            return result

        def on_step_end(handler: Any, args: Any, state: Any, control: Any) -> Any:
            if not probe.in_loop:  # an evaluation's or another trainer's steps: not this loop's
                return step_end(handler, args, state, control)
            t = time.perf_counter()
            result = step_end(handler, args, state, control)
            probe.step_end_seconds += time.perf_counter() - t
            probe.steps += 1
            probe.end = _usage()
            if state.global_step >= state.max_steps:
                probe.in_loop = False
                probe.threads_end = _thread_cpu()
                probe.state["heap_end"] = _heap()
            return result

        CallbackHandler.on_train_begin = on_train_begin  # type: ignore[method-assign]
        CallbackHandler.on_step_end = on_step_end  # type: ignore[method-assign]

    def figures(self) -> dict[str, Any]:
        if not self.steps or not self.start:
            return {"steps": 0}
        n = self.steps
        wall, user, system, faults = (b - a for a, b in zip(self.start, self.end))
        other = {
            k: round(v - self.threads_start.get(k, 0.0), 3)
            for k, v in self.threads_end.items()
            if v - self.threads_start.get(k, 0.0) > 0 and not k.startswith(f"{os.getpid()}:")
        }
        return dict(
            steps=n,
            wall=wall / n,
            cpu=(user + system) / n,
            user=user / n,
            system=system / n,
            minor_faults=faults / n,
            gc=self.gc_seconds / n,
            gc_collections=self.gc_collections,
            step_end_callbacks=self.step_end_seconds / n,
            # threads other than the main one that used CPU in the loop, seconds in all
            other_threads=other,
            state=self.state,
        )


def main(argv: list[str]) -> None:
    out, rest = argv[0], argv[1:]
    off: list[str] = []
    if rest[:1] == ["--off"]:
        off, rest = [p for p in rest[1].split(",") if p], rest[2:]
    unknown = sorted(set(off) - set(PARTS))
    if unknown:
        sys.exit(f"--off: unknown part(s) {unknown}; known: {sorted(PARTS)}")
    probe = Probe()
    probe.install()
    for part in off:
        PARTS[part]()

    def dump() -> None:
        with open(out, "w") as f:
            json.dump({"off": off, **probe.figures()}, f, indent=1)

    atexit.register(dump)
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
