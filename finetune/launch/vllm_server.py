"""GRPO's vLLM server beside the trainer: the lines of launch.sh that start it, wait for it and stop it.

For a server split (rollout.json `mode: server`), launch.sh starts `trl vllm-serve` in a session of its
own with `CUDA_VISIBLE_DEVICES` set to the server's GPUs and its output in `vllm_server.log`, traps EXIT
to stop that whole session (SIGTERM, then SIGKILL after a grace period: vLLM's workers go too), waits
with `python -m finetune.launch.vllm_server wait` until `GET /health` answers 200 (what TRL's
`VLLMClient.check_server` asks), and only then runs the trainer ranks on the other GPUs. SIGTERM/SIGINT
to the script go to the trainer (it saves and exits 75) and the server is stopped after it. A server
that exits or never answers within `objective.vllm_server_timeout_s` is one line and exit 2, nothing left
running. The lifecycle is in the script, not in a Python parent, so what runs is what a user reads.

In TRL 1.16 `trl vllm-serve` execs vLLM's own `vllm serve` (with `VLLM_SERVER_DEV_MODE=1` and the
weight-transfer flags TRL's client needs), so its process group is vLLM's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune.core.errors import FinetuneError, LaunchError

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


def http_ok(url: str, timeout: float) -> bool:
    """Does `url` answer 200?"""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (our own localhost URL)
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _devices(gpus: Sequence[int]) -> str:
    return ",".join(map(str, gpus))


def server_spec(
    rollout: dict[str, Any], model: str, grpo: Any, gpus: int, max_model_len: int, log: Path
) -> ServerSpec:
    """The server of a planned split (rollout.json) on this node's `gpus`: `trl vllm-serve` of `model`
    with the plan's sizes, at the address the trainer connects to (`objective.vllm_server_host` and port)."""
    server_gpus, train_gpus = split_gpus(int(rollout["server_gpus"]), gpus)
    argv = vllm_serve_argv(
        model,
        tensor_parallel=int(rollout["tensor_parallel"]),
        data_parallel=int(rollout["data_parallel"]),
        host=grpo.vllm_server_host,
        port=grpo.vllm_server_port,
        gpu_memory_utilization=float(rollout["vllm_gpu_memory_utilization"]),
        max_model_len=max_model_len,
    )
    host = f"[{grpo.vllm_server_host}]" if ":" in grpo.vllm_server_host else grpo.vllm_server_host
    return ServerSpec(
        argv=argv,
        server_gpus=server_gpus,
        train_gpus=train_gpus,
        health_url=f"http://{host}:{grpo.vllm_server_port}/health",
        timeout_s=float(grpo.vllm_server_timeout_s),
        log=str(log),
    )


def script_lines(spec: ServerSpec, python: str, trainer: str, grace_s: float = STOP_GRACE_S) -> list[str]:
    """launch.sh's body for a server split: start, trap, wait, then the trainer (`trainer`: its shell line)."""
    q = shlex.quote
    log = q(spec.log)
    server = " ".join(q(a) for a in spec.argv)
    return [
        f"# GRPO's rollout on a vLLM server (rollout.json): `trl vllm-serve` on GPUs {_devices(spec.server_gpus)}, "
        f"the trainer on {_devices(spec.train_gpus)}.",
        "# The server runs in a session of its own, stopped whole however this script ends (SIGTERM, then SIGKILL).",
        "VLLM_SERVER_PID=''",
        "TRAINER_PID=''",
        "SIGNALLED=''",
        "stop_vllm_server() {",
        '  [ -n "$VLLM_SERVER_PID" ] || return 0',
        '  kill -TERM -- "-$VLLM_SERVER_PID" 2>/dev/null || return 0',
        f'  for _ in $(seq {max(1, int(grace_s * 2))}); do kill -0 -- "-$VLLM_SERVER_PID" 2>/dev/null || return 0; sleep 0.5; done',
        '  kill -KILL -- "-$VLLM_SERVER_PID" 2>/dev/null || true',
        "}",
        "# SIGTERM/SIGINT: SIGTERM to the trainer, which saves and exits (75; a background job ignores SIGINT);",
        "# before it started, stop here",
        "on_signal() {",
        '  if [ -z "$TRAINER_PID" ]; then exit "$1"; fi',
        '  SIGNALLED=1; kill -TERM "$TRAINER_PID" 2>/dev/null || true',
        "}",
        "trap stop_vllm_server EXIT",
        "trap 'on_signal 143' TERM",
        "trap 'on_signal 130' INT",
        f"CUDA_VISIBLE_DEVICES={_devices(spec.server_gpus)} setsid {server} >>{log} 2>&1 </dev/null &",
        "VLLM_SERVER_PID=$!",
        f'{q(python)} -m finetune.launch.vllm_server wait --pid "$VLLM_SERVER_PID" '
        f"--timeout {spec.timeout_s:g} --log {log} {q(spec.health_url)} &",
        'wait "$!"',
        f"CUDA_VISIBLE_DEVICES={_devices(spec.train_gpus)} {trainer} &",
        "TRAINER_PID=$!",
        "# a signal interrupts `wait` (the trap passes it on): wait again until the trainer itself exits",
        'while :; do code=0; wait "$TRAINER_PID" || code=$?; kill -0 "$TRAINER_PID" 2>/dev/null || break; done',
        "# stopped by a signal it was passed: interrupted (75), as the launcher counts it",
        'if [ -n "$SIGNALLED" ] && [ "$code" -ne 0 ]; then code=75; fi',
        'exit "$code"',
    ]


def alive(pid: int) -> bool:
    """Is `pid` running (not gone, not a zombie its parent has yet to reap)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_until_up(
    running: Callable[[], bool],
    spec: ServerSpec,
    probe: Callable[[str, float], bool] = http_ok,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Until `spec.health_url` answers 200; a LaunchError once the server is gone or the timeout passed."""
    deadline = clock() + spec.timeout_s
    while True:
        if not running():
            raise LaunchError(f"vLLM server exited before answering {spec.health_url}; see {spec.log}")
        if probe(spec.health_url, 2.0):
            return
        if clock() >= deadline:
            raise LaunchError(
                f"vLLM server did not answer {spec.health_url} within {spec.timeout_s:g} s "
                f"(objective.vllm_server_timeout_s); see {spec.log}"
            )
        sleep(0.5)


def main(argv: Sequence[str]) -> int:
    """`wait --pid PID --timeout S --log LOG URL`: 0 once the server answers, else 2 with one line."""
    parser = argparse.ArgumentParser(prog="python -m finetune.launch.vllm_server")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait", help="wait until the vLLM server answers its health URL")
    wait.add_argument("--pid", type=int, required=True)
    wait.add_argument("--timeout", type=float, required=True)
    wait.add_argument("--log", required=True)
    wait.add_argument("url")
    args = parser.parse_args(argv)
    spec = ServerSpec(
        argv=[], server_gpus=[], train_gpus=[], health_url=args.url, timeout_s=args.timeout, log=args.log
    )
    try:
        wait_until_up(lambda: alive(args.pid), spec)
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
