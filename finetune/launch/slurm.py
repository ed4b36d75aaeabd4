"""`launch.scheduler=slurm`: an sbatch script, one task per node, srun + torchrun with rendezvous from SLURM.

The first host of the allocation hosts the c10d rendezvous; every node runs the
same line, so node ranks come from the rendezvous, not from the script.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Optional

from finetune import rundir
from finetune.core.config.launch import LaunchConfig
from finetune.core.errors import LaunchError
from finetune.launch.commands import python_of, tool, worker_args
from finetune.launch.engines import EngineFiles
from finetune.planner import Layout
from finetune.rundir import command_line, export_line, shell_comment


def sbatch_script(
    launch: LaunchConfig,
    lay: Layout,
    files: EngineFiles,
    run_dir: Path,
    run_name: str,
    env: dict[str, str],
    cwd: str,
    vcpus: Optional[int] = None,
) -> str:
    run_dir = Path(run_dir).resolve()
    q = shlex.quote
    job = re.sub(r"[^\w-]", "-", run_name) or "finetune"
    directives = [f"--job-name={job}", f"--nodes={lay.nnodes}", "--ntasks-per-node=1"]
    if lay.device == "cuda":
        directives.append(f"--gpus-per-node={lay.nproc_per_node}")
    cpus = launch.slurm_cpus_per_task or vcpus
    if cpus:
        directives.append(f"--cpus-per-task={cpus}")
    directives.append(f"--time={launch.slurm_time}")
    if launch.slurm_partition:
        directives.append(f"--partition={launch.slurm_partition}")
    if launch.slurm_account:
        directives.append(f"--account={launch.slurm_account}")
    directives += [f"--output={run_dir}/slurm-%j.out", f"--error={run_dir}/slurm-%j.err"]
    for d in directives:  # sbatch reads these lines itself: a newline would start a command of the script
        if re.search(r"[\x00-\x1f\x7f]", d):
            raise LaunchError(f"#SBATCH {d!r}: control characters in a SLURM option")

    worker = " ".join(q(a) for a in worker_args(run_dir))
    if launch.launcher == "accelerate" and files.accelerate_config is not None:
        run_line = (
            f"srun {q(tool(launch, 'accelerate'))} launch --config_file {q(str(files.accelerate_config))}"
            ' --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID"'
            f' --main_process_ip "$MASTER_ADDR" --main_process_port {launch.master_port} {worker}'
        )
    elif lay.world_size == 1:
        run_line = f"srun {q(python_of(launch))} {worker}"
    else:
        run_line = (
            f'srun {q(tool(launch, "torchrun"))} --nnodes "$SLURM_NNODES" --nproc_per_node {lay.nproc_per_node}'
            ' --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d'
            f' --rdzv_endpoint "$MASTER_ADDR:{launch.master_port}" {worker}'
        )
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives)]
    lines += [
        shell_comment(
            f"{run_name}: {lay.engine.runs_as} on {lay.nnodes} node(s) x {lay.nproc_per_node} process(es); "
            f"submit: {command_line('sbatch', run_dir / rundir.SBATCH_FILE)}"
        ),
        "set -euo pipefail",
        f"cd {q(cwd)}",
        *(export_line(k, v) for k, v in env.items()),
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        run_line,
    ]
    return "\n".join(lines) + "\n"
