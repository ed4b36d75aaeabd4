"""GRPO's vLLM server beside the trainer: start it on its GPUs, wait until it answers, train, stop it.

`python -m finetune.launch.vllm_server SPEC.json -- TRAINER ARGV...` is what `launch.sh` runs in
server mode: the spec (written by `write_spec`) holds the `trl vllm-serve` command line, the GPUs of
each side and the health URL. The server runs in its own session with `CUDA_VISIBLE_DEVICES` set to
its GPUs and its output in a log; the trainer runs with the other GPUs only after `GET /health` answers
200 (what TRL's `VLLMClient.check_server` asks). Whatever ends the trainer (exit, crash, a signal),
the server's whole process group is stopped: SIGTERM, then SIGKILL after a grace period. A server
that exits or never answers within the timeout is one line, exit 2, nothing left running.

In TRL 1.16 `trl vllm-serve` execs vLLM's own `vllm serve` (with `VLLM_SERVER_DEV_MODE=1` and the
weight-transfer flags TRL's client needs), so its process group is vLLM's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from finetune.core.errors import (
    INTERRUPTED_EXIT_CODE,
    FinetuneError,
    Interrupted,
    LaunchError,
    interrupt_on_signals,
)
from finetune.launch.runner import die_with_parent

# After SIGTERM, how long the server's process group may take to exit before SIGKILL.
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class ServerSpec:
    """What the launcher needs to run the server beside the trainer (written as JSON into the run dir)."""

    argv: list[str]
    server_gpus: list[int]
    train_gpus: list[int]
    health_url: str
    timeout_s: float
    log: str


def vllm_serve_argv(
    model: str,
    *,
    tensor_parallel: int,
    data_parallel: int,
    host: str,
    port: int,
    gpu_memory_utilization: float,
    max_model_len: Optional[int] = None,
) -> list[str]:
    """`trl vllm-serve` with the flags TRL documents (`--tensor-parallel-size`, `--data-parallel-size`)."""
    argv = [
        "trl",
        "vllm-serve",
        "--model",
        model,
        "--tensor-parallel-size",
        str(tensor_parallel),
        "--data-parallel-size",
        str(data_parallel),
        "--host",
        host,
        "--port",
        str(port),
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
    ]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    return argv


def split_gpus(server_gpus: int, total: int) -> tuple[list[int], list[int]]:
    """The first `server_gpus` devices serve, the rest train (as TRL's 4 + 4 example)."""
    if not 0 < server_gpus < total:
        raise LaunchError(f"vLLM server on {server_gpus} of {total} GPUs: each side needs at least one")
    return list(range(server_gpus)), list(range(server_gpus, total))


def write_spec(path: Path, spec: ServerSpec) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(spec), indent=2) + "\n")
    os.replace(tmp, path)


def read_spec(path: Path) -> ServerSpec:
    try:
        return ServerSpec(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise LaunchError(f"{path}: not a vLLM server spec ({exc})") from None


def http_ok(url: str, timeout: float) -> bool:
    """Does `url` answer 200?"""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (our own localhost URL)
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _devices(gpus: Sequence[int]) -> str:
    return ",".join(map(str, gpus))


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after `grace_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # children the server left behind in its group (vLLM's workers) go too
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_until_up(
    proc: subprocess.Popen,
    spec: ServerSpec,
    probe: Callable[[str, float], bool] = http_ok,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    deadline = clock() + spec.timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            raise LaunchError(
                f"vLLM server exited with code {code} before answering {spec.health_url}; see {spec.log}"
            )
        if probe(spec.health_url, 2.0):
            return
        if clock() >= deadline:
            raise LaunchError(
                f"vLLM server did not answer {spec.health_url} within {spec.timeout_s:g} s "
                f"(grpo.vllm_server_timeout_s); see {spec.log}"
            )
        sleep(0.5)


def serve_while_training(
    spec: ServerSpec,
    train: Callable[[dict[str, str]], int],
    probe: Callable[[str, float], bool] = http_ok,
    grace_s: float = STOP_GRACE_S,
) -> int:
    """Start the server, wait for it, run `train(env)` with the training GPUs, stop the server whatever
    happens; returns the trainer's exit code."""
    with open(spec.log, "ab") as log:
        proc = subprocess.Popen(
            die_with_parent(spec.argv),
            env={**os.environ, "CUDA_VISIBLE_DEVICES": _devices(spec.server_gpus)},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_until_up(proc, spec, probe)
        return train({"CUDA_VISIBLE_DEVICES": _devices(spec.train_gpus)})
    finally:
        stop(proc, grace_s)


def _run_trainer(argv: Sequence[str]) -> Callable[[dict[str, str]], int]:
    """The trainer as a child; while it runs, SIGTERM/SIGINT go to it (it saves and exits 75)."""

    def train(env: dict[str, str]) -> int:
        proc = subprocess.Popen(die_with_parent(argv), env={**os.environ, **env})

        def forward(signum: int, frame: object) -> None:
            if proc.poll() is None:
                proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    return train


def main(argv: Sequence[str]) -> int:
    """SPEC.json -- TRAINER ARGV...: the trainer's exit code, or 2 with one line."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m finetune.launch.vllm_server SPEC.json -- TRAINER ARGV...", file=sys.stderr)
        return 2
    # a signal while the server starts still runs the `finally` that stops it
    restore = interrupt_on_signals()
    try:
        spec = read_spec(Path(argv[0]))
        return serve_while_training(spec, _run_trainer(argv[2:]))
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:
        print(f"stopped by {exc.signal_name}; the vLLM server was stopped", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
