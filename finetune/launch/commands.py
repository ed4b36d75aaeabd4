"""The commands that start the ranks: one process, torchrun on a node or several, or accelerate launch.

Every rank runs `python -m finetune.train RUN_DIR` and reads config.yaml and
plan.json from the run directory; nothing is parsed from the command line again.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from finetune.core.config.launch import LaunchConfig
from finetune.core.errors import LaunchError
from finetune.launch.engines import EngineFiles
from finetune.planner import Layout
from finetune.rundir import export_line, shell_comment

WORKER_MODULE = "finetune.train"
# Stands for the node rank in launch.sh, so one script serves every node (NODE_RANK=i bash launch.sh).
NODE_RANK_SLOT = "@@NODE_RANK@@"


@dataclass(frozen=True)
class Command:
    """One process to start: argv, the environment added to os.environ, the working directory."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "."

    def shell(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv).replace(NODE_RANK_SLOT, '"$NODE_RANK"')


def python_of(launch: LaunchConfig) -> str:
    return launch.python or sys.executable


def tool(launch: LaunchConfig, name: str) -> str:
    """torchrun / accelerate of the interpreter that runs the ranks (a venv need not be on PATH)."""
    python = python_of(launch)
    if os.sep in python:
        sibling = Path(python).parent / name
        if sibling.is_file():
            return str(sibling)
    return shutil.which(name) or name


def rdzv_id(launch: LaunchConfig, run_name: str) -> str:
    return launch.rdzv_id or re.sub(r"[^\w-]", "-", run_name) or "finetune"


def worker_args(run_dir: Path) -> list[str]:
    return ["-m", WORKER_MODULE, str(run_dir)]


def torchrun_argv(
    launch: LaunchConfig, lay: Layout, run_dir: Path, run_name: str, node_rank: str
) -> list[str]:
    argv = [tool(launch, "torchrun")]
    if lay.nnodes == 1:
        # --standalone: a private rendezvous on a free local port (no clash with other jobs on the node).
        argv += ["--standalone", f"--nproc_per_node={lay.nproc_per_node}"]
    else:
        argv += [
            f"--nnodes={lay.nnodes}",
            f"--nproc_per_node={lay.nproc_per_node}",
            f"--node_rank={node_rank}",
        ]
        if launch.rdzv_backend == "c10d":
            argv += [
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={launch.master_addr}:{launch.master_port}",
                f"--rdzv_id={rdzv_id(launch, run_name)}",
            ]
        else:
            argv += [f"--master_addr={launch.master_addr}", f"--master_port={launch.master_port}"]
    if launch.max_restarts:
        argv.append(f"--max_restarts={launch.max_restarts}")
    return argv + worker_args(run_dir)


def accelerate_argv(
    launch: LaunchConfig, lay: Layout, files: EngineFiles, run_dir: Path, node_rank: str
) -> list[str]:
    if files.accelerate_config is None:
        raise LaunchError("launch.launcher=accelerate needs an accelerate config in the run dir")
    argv = [tool(launch, "accelerate"), "launch", "--config_file", str(files.accelerate_config)]
    if lay.nnodes > 1:
        argv += ["--machine_rank", node_rank]
    return argv + worker_args(run_dir)


def build_command(
    launch: LaunchConfig,
    lay: Layout,
    files: EngineFiles,
    run_dir: Path,
    run_name: str,
    env: dict[str, str],
    node_rank: Optional[str] = None,
) -> Command:
    """The command for this node. `node_rank` defaults to launch.node_rank; NODE_RANK_SLOT renders a script."""
    run_dir = Path(run_dir).resolve()
    rank = str(launch.node_rank) if node_rank is None else node_rank
    if launch.launcher == "accelerate":
        argv = accelerate_argv(launch, lay, files, run_dir, rank)
    elif lay.world_size == 1:
        argv = [python_of(launch), *worker_args(run_dir)]
    else:
        argv = torchrun_argv(launch, lay, run_dir, run_name, rank)
    return Command(argv=tuple(argv), env=dict(env), cwd=os.getcwd())


def launch_script(
    cmd: Command,
    lay: Layout,
    launch: LaunchConfig,
    header: list[str],
    run: Optional[Callable[[str], list[str]]] = None,
) -> str:
    """run_dir/launch.sh: the exact command with its environment; on several nodes NODE_RANK picks the node.
    `run` turns the command's shell line into the lines that run it (GRPO's server beside it); else `exec`."""
    lines = [
        "#!/usr/bin/env bash",
        *(shell_comment(h) for h in header),
        "set -euo pipefail",
        f"cd {shlex.quote(cmd.cwd)}",
    ]
    lines += [export_line(k, v) for k, v in cmd.env.items()]
    if lay.nnodes > 1:
        lines.append(
            f'NODE_RANK="${{NODE_RANK:-{launch.node_rank}}}"   # on node i: NODE_RANK=i bash launch.sh'
        )
    lines += run(cmd.shell()) if run is not None else [f"exec {cmd.shell()}"]
    return "\n".join(lines) + "\n"
