"""mode=launch: write the engine settings the plan chose, then start the ranks (or print how).

    python -m finetune +recipe=llama70b_full mode=launch launch.dry_run=true   # print, write launch.sh
    python -m finetune +recipe=llama70b_full mode=launch launch.detach=true    # tmux / nohup
    python -m finetune +recipe=llama70b_full mode=launch launch.scheduler=slurm

Ranks run `python -m finetune.train RUN_DIR` and read config.yaml and plan.json from there.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.config.launch import LaunchConfig
from finetune.core.errors import LaunchError
from finetune.core.objectives import ObjectiveSpec
from finetune.launch import vllm_server
from finetune.launch.commands import NODE_RANK_SLOT, Command, build_command, launch_script, python_of
from finetune.launch.engines import EngineFiles, launch_of, layout, nccl_env, write_engine_files
from finetune.launch.runner import (
    Probe,
    Runner,
    Which,
    detach,
    subprocess_runner,
    tcp_reachable,
    wait_for_rendezvous,
)
from finetune.launch.slurm import sbatch_script
from finetune.launch.vllm_server import ServerSpec
from finetune.modeling import models
from finetune.planner import Layout, Plan
from finetune.rundir.machine import Machine
from finetune.rundir.preflight import MachineCheck, check, check_machine, handoff


def describe(files: EngineFiles, lay: Layout, objective: ObjectiveSpec) -> str:
    s = lay.strategy
    offload = [
        name for name, on in (("optimizer", s.offload_optimizer), ("parameters", s.offload_params)) if on
    ]
    dp = lay.mesh.data_parallel  # a sequence split's ranks share each sequence
    examples = s.micro_batch_size * s.grad_accum_steps * dp
    sequences = examples * objective.sequences_per_example
    parts = [
        lay.engine.label,
        f"{lay.nnodes} node(s) x {lay.nproc_per_node} process(es)",
        f"micro-batch {s.micro_batch_size} x accumulation {s.grad_accum_steps} x {dp} data-parallel rank(s)"
        f" = {examples} {objective.batch_unit} a step"
        + (f" ({sequences} sequences)" if sequences != examples else "")
        + (f", each split over {lay.mesh.sequence} ranks" if lay.mesh.sequence > 1 else ""),
        f"offload to CPU: {', '.join(offload) if offload else 'none'}",
        f"activation checkpointing: {'on' if s.activation_checkpointing else 'off'}",
    ]
    return "; ".join(parts)


def run(
    cfg: Config,
    run_dir: Path,
    plan: Plan,
    *,
    launch: Optional[LaunchConfig] = None,
    runner: Runner = subprocess_runner,
    which: Which = shutil.which,
    probe: Probe = tcp_reachable,
    sleep: Callable[[float], None] = time.sleep,
    read_machine: Optional[Callable[[Optional[Path]], Machine]] = None,
    precheck: bool = False,
) -> int:
    """Write the engine files, then run, detach, submit to SLURM, or only print (dry_run). Returns the exit code.

    Ranks that start here are checked against this machine first (`preflight.check_machine`).
    `precheck` (the pipeline): when this process starts the ranks itself and waits for them, it also runs
    the disk, resume and host-RAM checks (`preflight.check`) and tells the ranks both ran
    (`preflight.handoff`), so they do not run them again; ranks started any other way check themselves.
    """
    launch = launch or launch_of(cfg)
    run_dir = Path(run_dir).resolve()
    _check_run_dir(run_dir, plan, launch)
    lay = layout(plan, launch)
    server = _rollout_server(cfg, run_dir, plan, launch)
    here = _check_this_machine(cfg, plan, launch, lay, read_machine)
    hand_down = precheck and not launch.dry_run and launch.scheduler == "none" and not launch.detach
    if hand_down:
        check(cfg, run_dir, plan)
    files = write_engine_files(cfg, plan, run_dir, launch)
    env = {**nccl_env(launch, lay), **here.env}
    _print_engine(files, lay, here, cfg.objective.spec)
    if launch.scheduler == "slurm":
        return _slurm(cfg, plan, launch, lay, files, run_dir, env, runner, which)

    cmd, script = _write_launch_script(cfg.name, launch, lay, files, run_dir, env, cfg.objective.spec, server)
    _print_command(cmd, script, lay, launch)
    if launch.dry_run:
        print("dry run: nothing started")
        return 0
    if lay.nnodes > 1 and launch.node_rank != 0:
        wait_for_rendezvous(
            launch.master_addr,
            launch.master_port,
            launch.rdzv_wait_s,
            launch.node_rank,
            probe=probe,
            sleep=sleep,
        )
    if launch.detach:
        return _detach(cfg.name, launch, script, run_dir, runner, which)
    # Not in launch.sh: a script run later, elsewhere or by hand, has its ranks check for themselves.
    checked = handoff(here) if hand_down else {}
    if server is not None:
        # the server's start, wait and stop are launch.sh's: it runs as written
        cmd = Command(argv=("bash", str(script)), env=cmd.env, cwd=cmd.cwd)
    return _run_ranks(cmd, checked, runner)


def _rollout_server(cfg: Config, run_dir: Path, plan: Plan, launch: LaunchConfig) -> Optional[ServerSpec]:
    """GRPO's server split (rollout.json `mode: server`): the `trl vllm-serve` launch.sh starts beside the
    trainer on this node's GPUs; None for every other rollout (or none). SLURM's script does not start a
    server yet: refused there before anything is submitted."""
    rollout = rundir.load_rollout(run_dir)
    if rollout is None or rollout["mode"] != "server" or not rollout.get("fits"):
        return None
    if launch.scheduler == "slurm" and not launch.dry_run:
        raise LaunchError(
            f"{run_dir / rundir.ROLLOUT_FILE}: the rollout is planned on a vLLM server, which the SLURM script "
            "does not start yet; run launch.sh on the node (launch.scheduler=none) or objective.generation=colocate"
        )
    settings = cfg.objective
    return vllm_server.server_spec(
        rollout,
        models.model_source(cfg.model),
        settings,
        gpus=plan.hardware.gpus_per_node,
        max_model_len=plan.seq_len,
        log=run_dir / rundir.VLLM_SERVER_LOG,
    )


def _check_run_dir(run_dir: Path, plan: Plan, launch: LaunchConfig) -> None:
    """config.yaml and plan.json are there for the ranks, and the plan fits (a dry run only warns)."""
    for name in (rundir.CONFIG_FILE, rundir.PLAN_FILE):
        if not (run_dir / name).is_file():
            raise LaunchError(
                f"{run_dir / name}: missing; the ranks read it (run mode=plan with this run_dir first)"
            )
    if not plan.fits:
        why = plan.reasons[0] if plan.reasons else ""
        message = f"the plan does not fit: {why} (see {run_dir / rundir.PLAN_FILE})"
        if not launch.dry_run:
            raise LaunchError(message + "; launch refuses a job that would run out of memory")
        print(f"warning: {message}")


def _check_this_machine(
    cfg: Config,
    plan: Plan,
    launch: LaunchConfig,
    lay: Layout,
    read_machine: Optional[Callable[[Optional[Path]], Machine]],
) -> MachineCheck:
    """This machine against the plan, where ranks start here (not a dry run; SLURM's nodes are not this machine)."""
    if launch.dry_run or launch.scheduler != "none":
        return MachineCheck({})
    return check_machine(
        cfg,
        plan,
        gpus=lay.nproc_per_node,
        device=lay.device,
        allow_mismatch=launch.allow_mismatch,
        read=read_machine,
    )


def _print_engine(files: EngineFiles, lay: Layout, here: MachineCheck, objective: ObjectiveSpec) -> None:
    print(f"launch: {describe(files, lay, objective)}")
    for path in (files.deepspeed, files.accelerate_config):
        if path is not None:
            print(f"  engine settings: {path}")
    for note in (*files.notes, *here.notes):
        print(f"  note: {note}")


def _write_launch_script(
    name: str,
    launch: LaunchConfig,
    lay: Layout,
    files: EngineFiles,
    run_dir: Path,
    env: dict[str, str],
    objective: ObjectiveSpec,
    server: Optional[ServerSpec] = None,
) -> tuple[Command, Path]:
    """The command for this node, and run_dir/launch.sh written to re-run it (on any node: NODE_RANK);
    with GRPO's vLLM server beside the trainer when the plan split the GPUs."""
    cmd = build_command(launch, lay, files, run_dir, name, env)
    script_cmd = build_command(launch, lay, files, run_dir, name, env, node_rank=NODE_RANK_SLOT)
    script = run_dir / rundir.LAUNCH_SCRIPT
    header = [
        f"{name}: {describe(files, lay, objective)}",
        "Written by mode=launch; re-run as is: " + rundir.command_line("bash", script),
    ]
    # Only the owner may read a script that names where its secrets come from.
    rundir.atomic_write_text(
        script,
        launch_script(
            script_cmd if lay.nnodes > 1 else cmd,
            lay,
            launch,
            header,
            run=None
            if server is None
            else lambda trainer: vllm_server.script_lines(server, python_of(launch), trainer),
        ),
        mode=0o700 if rundir.references_secrets(cmd.env) else 0o755,
    )
    return cmd, script


def _print_command(cmd: Command, script: Path, lay: Layout, launch: LaunchConfig) -> None:
    print("command:")
    for key, value in cmd.env.items():
        print(f"  {rundir.export_line(key, value)}")
    print(f"  {cmd.shell()}")
    print(f"script: {rundir.command_line(script)}")
    if lay.nnodes > 1:
        others = ", ".join(str(r) for r in range(lay.nnodes) if r != launch.node_rank)
        print(
            f"  on the other nodes ({others}): NODE_RANK=<rank> {rundir.command_line('bash', script)}  "
            "(or mode=launch launch.node_rank=<rank>)"
        )
    if lay.nnodes > 1 and launch.master_addr in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: launch.master_addr={launch.master_addr} is each node itself; give node 0's address")


def _detach(
    name: str, launch: LaunchConfig, script: Path, run_dir: Path, runner: Runner, which: Which
) -> int:
    """launch.sh started in a tmux session (or under nohup), its output in run_dir/launch.log."""
    session = launch.session or re.sub(r"[^\w-]", "-", f"ft-{name}")
    # The shell appends to the log and writes the pid file in place: never through a planted link.
    for path in (run_dir / rundir.LAUNCH_LOG, run_dir / rundir.LAUNCH_PID_FILE):
        rundir.check_target(path)
    for line in detach(script, run_dir / rundir.LAUNCH_LOG, session, runner, which):
        print(line)
    return 0


def _run_ranks(cmd: Command, checked: dict[str, str], runner: Runner) -> int:
    """The ranks started here, waited for; `checked` tells them which checks this process ran."""
    code = runner(list(cmd.argv), {**cmd.env, **checked}, cmd.cwd)
    if code != 0:
        print(f"launch: {Path(cmd.argv[0]).name} exited with {code}")
    return code


def _slurm(
    cfg: Config,
    plan: Plan,
    launch: LaunchConfig,
    lay: Layout,
    files: EngineFiles,
    run_dir: Path,
    env: dict[str, str],
    runner: Runner,
    which: Which,
) -> int:
    path = run_dir / rundir.SBATCH_FILE
    text = sbatch_script(launch, lay, files, run_dir, cfg.name, env, os.getcwd(), vcpus=plan.hardware.vcpus)
    rundir.atomic_write_text(path, text, mode=0o700 if rundir.references_secrets(env) else 0o644)
    submit = rundir.command_line("sbatch", path)
    print(f"sbatch script: {rundir.command_line(path)}")
    print(text, end="")
    if launch.dry_run:
        print(f"dry run: not submitted ({submit})")
        return 0
    sbatch = which("sbatch")
    if not sbatch:
        print(f"sbatch not found here: submit from the cluster's login node with  {submit}")
        return 0
    code = runner([sbatch, str(path)], {}, str(run_dir))
    if code == 0:
        print(f"submitted; logs: {rundir.command_line(run_dir)}/slurm-<jobid>.out  (squeue --me to watch)")
    else:
        print(f"launch: sbatch exited with {code}")
    return code
