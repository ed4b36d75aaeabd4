"""The launcher's vLLM server for GRPO's server split, proven with stand-ins (no vLLM, no GPU here).

launch.sh is generated from the 8-GPU recipe's plan and read line by line (the GPUs of each side, the
`trl vllm-serve` command TRL's own parser reads, the wait, the trap); then it runs with a stand-in `trl`
on PATH that records its pid, session and CUDA_VISIBLE_DEVICES and answers GET /health (as vLLM's
server does) after a delay, or never, or exits at once, or ignores SIGTERM, and a stand-in `torchrun`
beside launch.python that records what it saw. Checked: the trainer starts only once the server
answers, on the other GPUs; the server is gone after training ends, fails or is stopped by a signal;
a server that never comes up is one line and exit 2.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, Capture

from finetune import rundir
from finetune.core import rewards as reward_fns
from finetune.core.composition import compose
from finetune.core.errors import LaunchError
from finetune.launch import stage as launch_stage
from finetune.launch import vllm_server
from finetune.launch.vllm_server import ServerSpec, split_gpus, vllm_serve_argv
from finetune.pipeline.stages import plan_stage, resolve
from finetune.train.grpo_trainer import generation_mode, grpo_arguments

STAND_IN_SERVER = r"""#!{python}
import http.server, os, sys, time, signal
out, mode, port = os.environ["STAND_IN_OUT"], os.environ["STAND_IN_MODE"], int(sys.argv[sys.argv.index("--port") + 1])
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(out + "/server.tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{os.getsid(0)}} {{os.environ.get('CUDA_VISIBLE_DEVICES')}}\n" + "\n".join(sys.argv[1:]))
os.replace(out + "/server.tmp", out + "/server.txt")
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

# torchrun's stand-in: what it was given and whether the server already answered; `sleep` waits for SIGTERM
# and exits 75 as a rank that saved would.
STAND_IN_TRAINER = r"""#!{python}
import os, signal, sys, time, urllib.request
out = os.environ["STAND_IN_OUT"]
up = urllib.request.urlopen(os.environ["STAND_IN_HEALTH"], timeout=5).status
with open(out + "/trainer.txt", "w") as f:
    f.write(f"{{os.environ['CUDA_VISIBLE_DEVICES']}} {{up}} " + " ".join(sys.argv[1:]))
if os.environ.get("STAND_IN_TRAINER") == "sleep":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
    while True:
        time.sleep(0.1)
sys.exit(int(os.environ.get("STAND_IN_TRAINER", "0")))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def executable(path: Path, text: str) -> Path:
    path.write_text(text.format(python=sys.executable))
    path.chmod(0o755)
    return path


def stand_ins(tmp_path: Path) -> Path:
    """bin/ with `trl` (the server), `python` (the venv's, as launch.python) and `torchrun` beside it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "trl", STAND_IN_SERVER)
    executable(bin_dir / "torchrun", STAND_IN_TRAINER)
    executable(bin_dir / "python", f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    return bin_dir


def server_split(root: Path, port: int, timeout_s: float = 60.0) -> Path:
    """The 8-GPU GRPO recipe planned and launched as a dry run: run_dir/launch.sh written, nothing started."""
    run_dir = root / "run"
    run_dir.mkdir()
    cfg = resolve(
        compose(
            [
                "+recipe=llama8b_grpo_8gpu",
                f"run_dir={run_dir}",
                f"launch.python={root / 'bin' / 'python'}",
                f"objective.vllm_server_port={port}",
                f"objective.vllm_server_timeout_s={timeout_s}",
            ]
        )
    )
    rundir.save_config(cfg, run_dir)
    plan = plan_stage(cfg, run_dir, quiet=True)
    assert launch_stage.run(cfg, run_dir, plan, launch=replace_launch(cfg, dry_run=True)) == 0
    return run_dir


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One planned split for the tests that run launch.sh (each records into its own tmp_path)."""
    root = tmp_path_factory.mktemp("split")
    stand_ins(root)
    return server_split(root, free_port())


@pytest.fixture(scope="module")
def split_short_wait(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("split_short")
    stand_ins(root)
    return server_split(root, free_port(), timeout_s=1.5)


def replace_launch(cfg, **changes):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(cfg.launch, **changes)


def run_script(run_dir: Path, tmp_path: Path, mode: str, trainer: str = "0") -> subprocess.Popen:
    env = {
        **os.environ,
        "PATH": f"{run_dir.parent / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "STAND_IN_OUT": str(tmp_path),
        "STAND_IN_MODE": mode,
        "STAND_IN_TRAINER": trainer,
        "STAND_IN_HEALTH": health_url(run_dir),
    }
    return subprocess.Popen(
        ["bash", str(run_dir / "launch.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def health_url(run_dir: Path) -> str:
    line = next(x for x in (run_dir / "launch.sh").read_text().splitlines() if " wait --pid " in x)
    return line.split()[-2]


def server_record(tmp_path: Path) -> tuple[int, int, str, list[str]]:
    head, *argv = (tmp_path / "server.txt").read_text().split("\n")
    pid, sid, devices = head.split()
    return int(pid), int(sid), devices, argv


def group_gone(pgid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_command_line_is_what_trls_parser_reads() -> None:
    from trl.scripts.vllm_serve import build_command, make_parser

    argv = vllm_serve_argv(
        "/runs/a/model",
        tensor_parallel=4,
        data_parallel=1,
        host="0.0.0.0",
        port=8000,
        gpu_memory_utilization=0.9,
        max_model_len=1024,
    )
    assert argv[:2] == ["trl", "vllm-serve"]
    args, extra = make_parser().parse_args_into_dataclasses(argv[2:], return_remaining_strings=True)
    assert extra == []
    assert (args.model, args.tensor_parallel_size, args.data_parallel_size) == ("/runs/a/model", 4, 1)
    assert (args.host, args.port, args.gpu_memory_utilization, args.max_model_len) == (
        "0.0.0.0",
        8000,
        0.9,
        1024,
    )
    # what `trl vllm-serve` execs: vLLM's own server with the same sizes
    command = build_command(args)
    assert command[command.index("serve") + 1] == "/runs/a/model"
    assert command[command.index("--tensor-parallel-size") + 1] == "4"


def test_split_gpus_keeps_one_of_each_side() -> None:
    assert split_gpus(4, 8) == ([0, 1, 2, 3], [4, 5, 6, 7])
    with pytest.raises(LaunchError, match="each side needs at least one"):
        split_gpus(1, 1)


def test_launch_sh_starts_the_server_waits_traps_and_trains_on_the_other_gpus(tmp_path: Path) -> None:
    stand_ins(tmp_path)
    run_dir = server_split(tmp_path, port=8123, timeout_s=600)
    lines = (run_dir / "launch.sh").read_text().splitlines()
    log = run_dir / "vllm_server.log"
    python = tmp_path / "bin" / "python"
    # the plan's split: 4 data-parallel replicas serve, 4 ranks train 64 completions a step (4 x 4 x 4)
    assert lines[1].endswith(
        "micro-batch 4 x accumulation 4 x 4 data-parallel rank(s) = 64 sequences a step; "
        "offload to CPU: none; activation checkpointing: off"
    )
    expected = [
        "trap stop_vllm_server EXIT",
        "trap 'on_signal 143' TERM",
        "trap 'on_signal 130' INT",
        "CUDA_VISIBLE_DEVICES=0,1,2,3 setsid trl vllm-serve --model meta-llama/Llama-3.1-8B-Instruct "
        "--tensor-parallel-size 1 --data-parallel-size 4 --host 127.0.0.1 --port 8123 "
        f"--gpu-memory-utilization 0.9 --max-model-len 1024 >>{log} 2>&1 </dev/null &",
        "VLLM_SERVER_PID=$!",
        f'{python} -m finetune.launch.vllm_server wait --pid "$VLLM_SERVER_PID" --timeout 600 --log {log} '
        "http://127.0.0.1:8123/health &",
        'wait "$!"',
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 {tmp_path / 'bin' / 'torchrun'} --standalone --nproc_per_node=4 "
        f"-m finetune.train {run_dir} &",
        "TRAINER_PID=$!",
    ]
    start = lines.index(expected[0])
    assert lines[start : start + len(expected)] == expected
    assert '  kill -TERM -- "-$VLLM_SERVER_PID" 2>/dev/null || return 0' in lines
    assert not any(line.startswith("exec ") for line in lines)
    # the trainer ranks connect to that server: TRL's server mode at the same host and port
    cfg = rundir.load_config(run_dir)
    rewards = reward_fns.resolve(cfg.objective.rewards, cfg.objective.reward_weights)
    args = grpo_arguments(cfg.objective, rewards, generation_mode(cfg, run_dir))
    assert (args["use_vllm"], args["vllm_mode"], args["vllm_server_host"], args["vllm_server_port"]) == (
        True,
        "server",
        "127.0.0.1",
        8123,
    )
    assert args["vllm_server_timeout"] == 600


def test_mode_train_runs_launch_sh_itself(split: Path) -> None:
    """Started from the pipeline, the ranks go through launch.sh, which owns the server's lifecycle."""
    run_dir = split
    cfg = rundir.load_config(run_dir)
    runner = Capture()
    code = launch_stage.run(
        cfg,
        run_dir,
        rundir.load_plan(run_dir),
        launch=replace_launch(cfg, allow_mismatch=True),
        runner=runner,
        read_machine=lambda _: _eight_h100s(),
    )
    assert code == 0
    assert [argv for argv, _, _ in runner.calls] == [["bash", str(run_dir / "launch.sh")]]


def _eight_h100s():  # type: ignore[no-untyped-def]
    from finetune.rundir.machine import GPU, Machine

    h100 = GPU("NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0))
    return Machine(gpus=(h100,) * 8, host_memory_bytes=2 * 10**12, cpu_count=208)


@pytest.mark.parametrize("trainer_exit", ["0", "7"])
def test_server_up_before_the_trainer_and_gone_after_it(
    split: Path, tmp_path: Path, trainer_exit: str
) -> None:
    run_dir = split
    port = int(health_url(run_dir).rsplit(":", 1)[1].split("/")[0])
    done = run_script(run_dir, tmp_path, "up", trainer_exit)
    out, err = done.communicate(timeout=120)
    assert done.returncode == int(trainer_exit), err
    pid, sid, devices, argv = server_record(tmp_path)
    # the server in a session of its own, on the first four GPUs, with the plan's flags
    assert (sid, devices) == (pid, "0,1,2,3")
    assert argv == [
        "vllm-serve", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "1",
        "--data-parallel-size", "4", "--host", "127.0.0.1", "--port", str(port),
        "--gpu-memory-utilization", "0.9", "--max-model-len", "1024",
    ]  # fmt: skip
    # the trainer saw the other GPUs and a server that already answered 200
    assert (tmp_path / "trainer.txt").read_text() == (
        f"4,5,6,7 200 --standalone --nproc_per_node=4 -m finetune.train {run_dir}"
    )
    assert group_gone(pid)


def test_a_server_that_never_answers_is_one_line_and_exit_2(split_short_wait: Path, tmp_path: Path) -> None:
    run_dir = split_short_wait
    start = time.monotonic()
    done = run_script(run_dir, tmp_path, "never")
    _, err = done.communicate(timeout=120)
    assert done.returncode == 2
    assert err.strip() == (
        f"error: vLLM server did not answer {health_url(run_dir)} within 1.5 s (objective.vllm_server_timeout_s); "
        f"see {run_dir / 'vllm_server.log'}"
    )
    assert not (tmp_path / "trainer.txt").exists()
    assert group_gone(server_record(tmp_path)[0])
    assert time.monotonic() - start < 60


def test_a_server_that_exits_is_one_line_and_exit_2(split_short_wait: Path, tmp_path: Path) -> None:
    run_dir = split_short_wait
    done = run_script(run_dir, tmp_path, "exit")
    _, err = done.communicate(timeout=120)
    assert done.returncode == 2
    assert err.strip() == (
        f"error: vLLM server exited before answering {health_url(run_dir)}; see {run_dir / 'vllm_server.log'}"
    )
    assert not (tmp_path / "trainer.txt").exists()


def test_sigterm_goes_to_the_trainer_then_the_server_is_stopped(split: Path, tmp_path: Path) -> None:
    run_dir = split
    proc = run_script(run_dir, tmp_path, "up", "sleep")
    deadline = time.monotonic() + 60
    while not (tmp_path / "trainer.txt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    # the trainer saved and exited 75 (interrupted); the server went after it
    assert proc.returncode == 75
    assert group_gone(server_record(tmp_path)[0])


def test_a_server_that_ignores_sigterm_is_killed_when_the_trainer_fails(tmp_path: Path) -> None:
    stand_ins(tmp_path)
    port = free_port()
    spec = ServerSpec(
        argv=["trl", "vllm-serve", "--port", str(port)],
        server_gpus=[0],
        train_gpus=[1],
        health_url=f"http://127.0.0.1:{port}/health",
        timeout_s=30,
        log=str(tmp_path / "vllm_server.log"),
    )
    # "up" for this stand-in: it ignores SIGTERM and never answers, so the trainer is started at once
    lines = vllm_server.script_lines(spec, sys.executable, "exit 9", grace_s=0.5)
    wait = next(i for i, x in enumerate(lines) if " wait --pid " in x)
    lines[wait : wait + 2] = ['while [ ! -e "$STAND_IN_OUT/server.txt" ]; do sleep 0.05; done']
    script = tmp_path / "launch.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(lines) + "\n")
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "STAND_IN_OUT": str(tmp_path),
        "STAND_IN_MODE": "stubborn",
    }
    start = time.monotonic()
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 9
    assert group_gone(server_record(tmp_path)[0], timeout=5)
    # SIGTERM ignored for the grace period, then SIGKILL
    assert 0.5 <= time.monotonic() - start < 30
