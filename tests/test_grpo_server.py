"""The launcher's vLLM server for GRPO, proven with a stand-in server process (no vLLM here).

The stand-in records its pid and CUDA_VISIBLE_DEVICES, answers GET /health (as vLLM's server does) after
a delay, or never, or exits at once, or ignores SIGTERM; the trainer is a child that records what it saw.
Checked: the command line TRL's own parser reads, the GPUs of each side, that the trainer starts only once
the server answers, that the server is gone after training ends or fails, and the one-line exit 2.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO

from finetune.core.errors import LaunchError
from finetune.launch.vllm_server import (
    ServerSpec,
    serve_while_training,
    split_gpus,
    vllm_serve_argv,
    write_spec,
)

STAND_IN = r"""
import http.server, os, sys, time, signal
pid_file, mode, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(pid_file + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.environ.get('CUDA_VISIBLE_DEVICES')}")
os.replace(pid_file + ".tmp", pid_file)
if mode == "exit":
    sys.exit(3)
if mode in ("never", "stubborn"):
    while True:
        time.sleep(1)
time.sleep(0.5)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

TRAINER = r"""
import os, sys, urllib.request
up = urllib.request.urlopen(sys.argv[2], timeout=5).status
with open(sys.argv[1], "w") as f:
    f.write(f"{os.environ['CUDA_VISIBLE_DEVICES']} {up}")
sys.exit(int(sys.argv[3]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spec(tmp_path: Path, mode: str, timeout_s: float = 30.0) -> ServerSpec:
    port = free_port()
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    server, train = split_gpus(4, 8)
    return ServerSpec(
        argv=[sys.executable, str(tmp_path / "stand_in.py"), str(tmp_path / "server.pid"), mode, str(port)],
        server_gpus=server,
        train_gpus=train,
        health_url=f"http://127.0.0.1:{port}/health",
        timeout_s=timeout_s,
        log=str(tmp_path / "vllm_server.log"),
    )


def server_pid(tmp_path: Path) -> tuple[int, str]:
    pid, devices = (tmp_path / "server.pid").read_text().split()
    return int(pid), devices


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run_wrapper(tmp_path: Path, s: ServerSpec, trainer_exit: int) -> subprocess.CompletedProcess:
    write_spec(tmp_path / "vllm_server.json", s)
    (tmp_path / "trainer.py").write_text(TRAINER)
    trainer = [
        sys.executable,
        str(tmp_path / "trainer.py"),
        str(tmp_path / "trainer.txt"),
        s.health_url,
        str(trainer_exit),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [
        sys.executable,
        "-m",
        "finetune.launch.vllm_server",
        str(tmp_path / "vllm_server.json"),
        "--",
        *trainer,
    ]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_command_line_is_what_trls_parser_reads() -> None:
    from trl.scripts.vllm_serve import build_command, make_parser

    argv = vllm_serve_argv(
        "/runs/a/model",
        tensor_parallel=4,
        data_parallel=1,
        host="0.0.0.0",
        port=8000,
        gpu_memory_utilization=0.9,
    )
    assert argv[:2] == ["trl", "vllm-serve"]
    args, extra = make_parser().parse_args_into_dataclasses(argv[2:], return_remaining_strings=True)
    assert extra == []
    assert (args.model, args.tensor_parallel_size, args.data_parallel_size) == ("/runs/a/model", 4, 1)
    assert (args.host, args.port, args.gpu_memory_utilization) == ("0.0.0.0", 8000, 0.9)
    # what `trl vllm-serve` execs: vLLM's own server with the same sizes
    command = build_command(args)
    assert command[command.index("serve") + 1] == "/runs/a/model"
    assert command[command.index("--tensor-parallel-size") + 1] == "4"


def test_split_gpus_keeps_one_of_each_side() -> None:
    assert split_gpus(4, 8) == ([0, 1, 2, 3], [4, 5, 6, 7])
    with pytest.raises(LaunchError, match="each side needs at least one"):
        split_gpus(1, 1)


@pytest.mark.parametrize("trainer_exit", [0, 7])
def test_server_up_before_the_trainer_and_gone_after_it(tmp_path: Path, trainer_exit: int) -> None:
    s = spec(tmp_path, "up")
    done = run_wrapper(tmp_path, s, trainer_exit)
    assert done.returncode == trainer_exit, done.stderr
    pid, devices = server_pid(tmp_path)
    assert devices == "0,1,2,3"
    # the trainer saw the other GPUs and a server that already answered 200
    assert (tmp_path / "trainer.txt").read_text() == "4,5,6,7 200"
    assert gone(pid)


def test_a_server_that_never_answers_is_one_line_and_exit_2(tmp_path: Path) -> None:
    s = spec(tmp_path, "never", timeout_s=1.5)
    start = time.monotonic()
    done = run_wrapper(tmp_path, s, 0)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error: vLLM server did not answer {s.health_url} within 1.5 s (grpo.vllm_server_timeout_s); see {s.log}"
    )
    assert not (tmp_path / "trainer.txt").exists()
    assert gone(server_pid(tmp_path)[0])
    assert time.monotonic() - start < 60


def test_a_server_that_exits_is_named_with_its_code(tmp_path: Path) -> None:
    s = spec(tmp_path, "exit")
    done = run_wrapper(tmp_path, s, 0)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"error: vLLM server exited with code 3 before answering {s.health_url}; see {s.log}"
    )
    assert not (tmp_path / "trainer.txt").exists()


def test_a_server_that_ignores_sigterm_is_killed_and_a_failing_trainer_still_stops_it(tmp_path: Path) -> None:
    s = spec(tmp_path, "stubborn")

    def crash(env: dict[str, str]) -> int:
        assert env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
        raise RuntimeError("trainer died")

    with pytest.raises(RuntimeError, match="trainer died"):
        # "up" once the stand-in has ignored SIGTERM and said so
        serve_while_training(
            s, crash, probe=lambda url, timeout: (tmp_path / "server.pid").exists(), grace_s=0.5
        )
    assert gone(server_pid(tmp_path)[0])
