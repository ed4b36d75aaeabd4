"""Side effects of launching, behind small parameters tests replace: the process runner and the TCP probe.

A runner takes (argv, env added to os.environ, cwd) and returns the exit code,
as TRL's launcher and httpx's MockTransport let tests capture what would run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Optional

from finetune import rundir
from finetune.core.errors import LaunchError

Runner = Callable[[Sequence[str], Mapping[str, str], str], int]
Probe = Callable[[str, int, float], bool]
Which = Callable[[str], Optional[str]]


# Put in front of the command on Linux: PR_SET_PDEATHSIG (kept across exec) has the kernel send the
# command SIGTERM when this process dies, even by SIGKILL, so the training worker stops (saving a
# checkpoint) instead of writing on as an orphan; if the parent is already gone, nothing starts.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit(75)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` so that it receives SIGTERM when this process dies (Linux; elsewhere `argv` unchanged)."""
    import sys

    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def subprocess_runner(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> int:
    """Run and wait; SIGTERM/SIGINT go to the child (it saves a checkpoint, exits 75) and we keep waiting.

    The child inherits the run directory's lock (`rundir.held_fds`), so it holds the lock itself for as
    long as it lives, and it receives SIGTERM if this process dies (`die_with_parent`). A child that
    fails after this process forwarded it a signal was interrupted: 75.
    """
    import signal
    import threading

    if shutil.which(argv[0]) is None:  # checked here: behind the guard, exec would fail in the child
        raise LaunchError(
            f"{argv[0]}: not found; install the project's environment there (or set launch.python=PATH)"
        )
    fds = rundir.held_fds()
    lock_env = {rundir.LOCK_FDS_ENV: ",".join(map(str, fds))} if fds else {}
    try:
        proc = subprocess.Popen(
            die_with_parent(argv),
            env={**os.environ, **env, **lock_env},
            cwd=cwd,
            start_new_session=True,
            pass_fds=fds,
        )
    except FileNotFoundError:
        raise LaunchError(
            f"{argv[0]}: not found; install the project's environment there (or set launch.python=PATH)"
        ) from None
    forwarded: list[int] = []

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if forwarded and code != 0:  # torchrun reports its stopped ranks as a failure (1): still a stop by signal
        return 75
    return code


def tcp_reachable(host: str, port: int, timeout: float) -> bool:
    """Can this node open a TCP connection to host:port? (Name resolution failures count as unreachable.)"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_rendezvous(
    host: str,
    port: int,
    wait_s: float,
    node_rank: int,
    probe: Probe = tcp_reachable,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Nodes other than 0: wait for node 0's rendezvous port, then fail with what to check.

    torchrun alone would wait out its own long timeout with a stack trace; this says it in one line.
    """
    try:
        socket.getaddrinfo(host, port)
    except OSError:
        raise LaunchError(
            f"launch.master_addr={host}: cannot resolve this name from node_rank {node_rank}; use node 0's IP address"
        ) from None
    deadline = clock() + wait_s
    while True:
        if probe(host, port, min(2.0, max(wait_s, 0.1))):
            return
        if clock() >= deadline:
            raise LaunchError(
                f"rendezvous {host}:{port} unreachable from node_rank {node_rank} after {wait_s:g} s: start node_rank 0 "
                "first, and check launch.master_addr/launch.master_port and that the port is open between the nodes"
            )
        sleep(1.0)


def detach(script: Path, log: Path, session: str, runner: Runner, which: Which) -> list[str]:
    """Start `bash script` so it outlives this shell: in tmux when present, else under nohup.

    Returns the lines that tell the user how to attach and follow the log.
    """
    script_q, log_q = shlex.quote(str(script)), shlex.quote(str(log))
    cwd = str(script.parent)
    if which("tmux"):
        inner = f"bash {script_q} 2>&1 | tee -a {log_q}; exit ${{PIPESTATUS[0]}}"
        code = runner(["tmux", "new-session", "-d", "-s", session, f"bash -c {shlex.quote(inner)}"], {}, cwd)
        attach = rundir.command_line("tmux", "attach", "-t", session)
        if code != 0:
            raise LaunchError(
                f"tmux could not start session {session!r} (exit {code}); if it exists: {attach}, "
                "or choose another name with launch.session=NAME"
            )
        return [
            f"started in tmux session {session!r}",
            f"  attach:  {attach}      (detach again: Ctrl-b d)",
            f"  follow:  {rundir.command_line('tail', '-f', log)}",
        ]
    pid_file = script.with_name(rundir.LAUNCH_PID_FILE)
    line = f"nohup bash {script_q} > {log_q} 2>&1 < /dev/null & echo $! > {shlex.quote(str(pid_file))}"
    code = runner(["bash", "-c", line], {}, cwd)
    if code != 0:
        raise LaunchError(f"nohup could not start {script} (exit {code})")
    return [
        "started under nohup (tmux not found)",
        f"  follow:  {rundir.command_line('tail', '-f', log)}",
        f"  stop:    kill $({rundir.command_line('cat', pid_file)})",
    ]
