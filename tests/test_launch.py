"""mode=launch: commands, launch.sh, detach, rendezvous check, SLURM; the process runner is captured, not run."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import socket
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import Capture, child_env, planned, planned_run_dir, run_cli
from omegaconf import OmegaConf

from finetune import rundir
from finetune.core.composition import compose, load_profiles, package_dir
from finetune.core.config import Config, LaunchConfig
from finetune.core.errors import ConfigError, LaunchError
from finetune.launch import stage
from finetune.launch.runner import subprocess_runner, wait_for_rendezvous
from finetune.pipeline.stages import resolve
from finetune.planner import Plan
from finetune.rundir.machine import GPU, Machine

H200 = GPU("NVIDIA H200", 150_011_707_392, (9, 0))  # what torch.cuda reports for one H200
A100_40 = GPU("NVIDIA A100-SXM4-40GB", 42_405_855_232, (8, 0))


def node(*gpus: GPU) -> Machine:
    return Machine(gpus=gpus, host_memory_bytes=2_000 * 10**9, cpu_count=192)


@pytest.fixture(autouse=True)
def eight_h200(monkeypatch):
    """The llama70b_full plans are for h200x8: these launches start on a stand-in 8 x H200 node."""
    monkeypatch.setattr("finetune.rundir.machine.read_machine", lambda run_dir=None: node(*[H200] * 8))


@pytest.fixture(scope="module")
def llama70b_full() -> tuple[Config, Plan]:
    return planned("+recipe=llama70b_full")


@pytest.fixture
def run70(tmp_path, llama70b_full) -> tuple[Config, Plan, Path]:
    cfg, plan = llama70b_full
    run_dir = (tmp_path / "run").resolve()
    run_dir.mkdir()
    rundir.save_config(cfg, run_dir)
    rundir.write_json(run_dir / rundir.PLAN_FILE, plan.to_dict())
    return cfg, plan, run_dir


# ---------------------------------------------------------------- config


def test_default_yaml_matches_the_schema():
    path = package_dir("configs") / "launch" / "default.yaml"
    raw = OmegaConf.load(path)
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(LaunchConfig)}
    loaded = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LaunchConfig), raw))
    assert loaded == LaunchConfig()


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"launcher": "mpirun"}, "launch.launcher"),
        ({"scheduler": "pbs"}, "launch.scheduler"),
        ({"nnodes": 2, "node_rank": 2}, "launch.node_rank"),
        ({"master_port": 70000}, "launch.master_port"),
        ({"nproc_per_node": 0}, "launch.nproc_per_node"),
        ({"session": "a.b"}, "launch.session"),
        ({"slurm_time": "one day"}, "launch.slurm_time"),
        ({"env": {"BAD-NAME": "1"}}, "launch.env.BAD-NAME"),
    ],
)
def test_bad_launch_values_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LaunchConfig(**kwargs)


# ---------------------------------------------------------------- commands


def test_dry_run_70b_full_prints_torchrun_for_8_gpus_and_runs_nothing(run70, capsys):
    cfg, plan, run_dir = run70
    runner = Capture()
    assert stage.run(cfg, run_dir, plan, launch=LaunchConfig(dry_run=True), runner=runner) == 0
    assert runner.calls == []
    out = capsys.readouterr().out
    assert "DeepSpeed ZeRO-3" in out and "offload to CPU: optimizer" in out
    line = next(x for x in out.splitlines() if "torchrun" in x)
    argv = shlex.split(line)
    assert Path(argv[0]).name == "torchrun"
    assert argv[1:] == ["--standalone", "--nproc_per_node=8", "-m", "finetune.train", str(run_dir)]
    script = run_dir / "launch.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text and "export DEEPSPEED_TIMEOUT=30" in text
    assert f"exec {line.strip()}" in text
    assert (run_dir / "deepspeed.json").is_file()
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_run_passes_argv_env_and_exit_code_through_the_runner(run70):
    cfg, plan, run_dir = run70
    runner = Capture(code=3)
    launch = LaunchConfig(nccl_timeout_s=600, nccl_debug="WARN", env={"HF_HOME": "/nvme/hf"})
    assert stage.run(cfg, run_dir, plan, launch=launch, runner=runner) == 3
    [(argv, env, cwd)] = runner.calls
    assert argv[-3:] == ["-m", "finetune.train", str(run_dir)] and "--nproc_per_node=8" in argv
    assert env == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_DEBUG": "WARN",
        "DEEPSPEED_TIMEOUT": "10",
        "HF_HOME": "/nvme/hf",
    }
    assert cwd == os.getcwd()


def test_one_device_is_one_plain_process(tmp_path):
    cfg, plan, run_dir = planned_run_dir(tmp_path, "+recipe=tiny")
    runner = Capture()
    assert stage.run(cfg, run_dir, plan, launch=LaunchConfig(), runner=runner) == 0
    [(argv, env, _)] = runner.calls
    assert argv == [sys.executable, "-m", "finetune.train", str(run_dir)]
    assert env == {}


def test_two_cpu_processes_get_torchrun_and_accelerate_use_cpu(tmp_path):
    cfg, plan, run_dir = planned_run_dir(tmp_path, "+recipe=tiny", "hardware.gpus_per_node=2")
    runner = Capture()
    stage.run(cfg, run_dir, plan, launch=LaunchConfig(), runner=runner)
    [(argv, env, _)] = runner.calls
    assert Path(argv[0]).name == "torchrun" and "--nproc_per_node=2" in argv
    assert env["ACCELERATE_USE_CPU"] == "true"


def test_several_nodes_use_c10d_rendezvous_and_one_script_for_every_node(run70, capsys):
    cfg, plan, run_dir = run70
    launch = LaunchConfig(nnodes=2, node_rank=0, master_addr="10.1.2.3", master_port=29400, dry_run=True)
    stage.run(cfg, run_dir, plan, launch=launch, runner=Capture())
    out = capsys.readouterr().out
    argv = shlex.split(next(x for x in out.splitlines() if "torchrun" in x))
    assert argv[1:] == [
        "--nnodes=2",
        "--nproc_per_node=8",
        "--node_rank=0",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.1.2.3:29400",
        f"--rdzv_id={cfg.name}",
        "-m",
        "finetune.train",
        str(run_dir),
    ]
    assert "NODE_RANK=<rank> bash" in out
    # DeepSpeed's batch covers both nodes.
    assert '"train_batch_size": 128' in (run_dir / "deepspeed.json").read_text()
    text = (run_dir / "launch.sh").read_text()
    assert 'NODE_RANK="${NODE_RANK:-0}"' in text and '--node_rank="$NODE_RANK"' in text


def test_launch_sh_runs_with_node_rank_from_the_environment(tmp_path, run70):
    """Execute the generated script against stand-in tools: the exact argv reaches torchrun."""
    cfg, plan, run_dir = run70
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "argv.txt"
    for name in ("python", "torchrun"):
        fake = bindir / name
        fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@" > {record}\n')
        fake.chmod(0o755)
    launch = LaunchConfig(nnodes=2, master_addr="10.1.2.3", python=str(bindir / "python"), dry_run=True)
    stage.run(cfg, run_dir, plan, launch=launch, runner=Capture())
    subprocess.run(["bash", str(run_dir / "launch.sh")], env={**os.environ, "NODE_RANK": "1"}, check=True)
    lines = record.read_text().splitlines()
    assert lines[0] == "torchrun" and "--node_rank=1" in lines and lines[-1] == str(run_dir)


def test_accelerate_launcher_multi_node_passes_machine_rank(run70, capsys):
    cfg, plan, run_dir = run70
    runner = Capture()
    launch = LaunchConfig(launcher="accelerate", nnodes=2, node_rank=1, master_addr="127.0.0.1")
    stage.run(cfg, run_dir, plan, launch=launch, runner=runner, probe=lambda h, p, t: True)
    [(argv, _, _)] = runner.calls
    assert Path(argv[0]).name == "accelerate"
    assert argv[1:] == [
        "launch",
        "--config_file",
        str(run_dir / "accelerate.yaml"),
        "--machine_rank",
        "1",
        "-m",
        "finetune.train",
        str(run_dir),
    ]
    assert "warning: launch.master_addr=127.0.0.1 is each node itself" in capsys.readouterr().out


def test_unreachable_rendezvous_is_a_clear_launch_error(run70):
    cfg, plan, run_dir = run70
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = Capture()
    launch = LaunchConfig(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port, rdzv_wait_s=0)
    with pytest.raises(
        LaunchError, match=rf"127\.0\.0\.1:{port} unreachable from node_rank 1.*start node_rank 0"
    ):
        stage.run(cfg, run_dir, plan, launch=launch, runner=runner)
    assert runner.calls == []


def test_rendezvous_wait_retries_until_node_0_is_up():
    answers = iter([False, False, True])
    clock = iter([0.0, 1.0, 2.0, 3.0])
    wait_for_rendezvous(
        "127.0.0.1",
        29500,
        10,
        1,
        probe=lambda h, p, t: next(answers),
        sleep=lambda s: None,
        clock=lambda: next(clock),
    )
    with pytest.raises(LaunchError, match="cannot resolve"):
        wait_for_rendezvous("no-such-host.invalid", 29500, 0, 1)


def test_node_0_does_not_wait_for_itself(run70):
    cfg, plan, run_dir = run70
    runner = Capture()

    def probe(*_):
        raise AssertionError("node 0 hosts the rendezvous; it must not probe it")

    stage.run(cfg, run_dir, plan, launch=LaunchConfig(nnodes=2, node_rank=0), runner=runner, probe=probe)
    assert len(runner.calls) == 1


# ---------------------------------------------------------------- detach


def test_detach_uses_tmux_and_says_how_to_attach(run70, capsys):
    cfg, plan, run_dir = run70
    runner = Capture()
    launch = LaunchConfig(detach=True, session="exp1")
    assert stage.run(cfg, run_dir, plan, launch=launch, runner=runner, which=lambda n: f"/usr/bin/{n}") == 0
    [(argv, _, _)] = runner.calls
    assert argv[:5] == ["tmux", "new-session", "-d", "-s", "exp1"]
    inner = shlex.split(argv[5])
    assert inner[:2] == ["bash", "-c"]
    assert inner[2].startswith(f"bash {run_dir / 'launch.sh'} 2>&1 | tee -a {run_dir / 'launch.log'}")
    out = capsys.readouterr().out
    assert "tmux attach -t exp1" in out and f"tail -f {run_dir / 'launch.log'}" in out


def test_detach_falls_back_to_nohup_and_a_failed_tmux_is_an_error(run70, capsys):
    cfg, plan, run_dir = run70
    runner = Capture()
    stage.run(cfg, run_dir, plan, launch=LaunchConfig(detach=True), runner=runner, which=lambda n: None)
    [(argv, _, _)] = runner.calls
    assert argv[:2] == ["bash", "-c"] and argv[2].startswith(f"nohup bash {run_dir / 'launch.sh'} > ")
    assert "tail -f" in capsys.readouterr().out
    with pytest.raises(LaunchError, match="tmux attach -t ft-llama70b_full"):
        stage.run(
            cfg,
            run_dir,
            plan,
            launch=LaunchConfig(detach=True),
            runner=Capture(code=1),
            which=lambda n: "/usr/bin/tmux",
        )


def test_nohup_detach_really_outlives_the_launcher(tmp_path):
    """The real runner and nohup: the script keeps running after `bash -c` has returned."""
    from finetune.launch.runner import detach

    script = tmp_path / "launch.sh"
    done = tmp_path / "done"
    script.write_text(f"sleep 0.5; echo finished; touch {done}\n")
    lines = detach(script, tmp_path / "launch.log", "s", subprocess_runner, which=lambda n: None)
    assert not done.exists() and any("tail -f" in x for x in lines)
    for _ in range(100):
        if done.exists():
            break
        time.sleep(0.1)
    assert (tmp_path / "launch.log").read_text() == "finished\n"
    assert (tmp_path / "launch.pid").read_text().strip().isdigit()


# ---------------------------------------------------------------- refusals


def test_a_plan_that_does_not_fit_is_not_launched(run70, capsys):
    cfg, plan, run_dir = run70
    unfit = replace(plan, fits=False, reasons=("weights: 141 GB per GPU needed",))
    with pytest.raises(LaunchError, match="does not fit: weights"):
        stage.run(cfg, run_dir, unfit, launch=LaunchConfig(), runner=Capture())
    assert stage.run(cfg, run_dir, unfit, launch=LaunchConfig(dry_run=True), runner=Capture()) == 0
    assert "warning: the plan does not fit" in capsys.readouterr().out


def test_a_machine_unlike_the_plan_is_refused_before_anything_is_written(run70):
    cfg, plan, run_dir = run70
    runner = Capture()
    eight_a100 = node(*[A100_40] * 8)
    with pytest.raises(LaunchError) as err:
        stage.run(cfg, run_dir, plan, launch=LaunchConfig(), runner=runner, read_machine=lambda _: eight_a100)
    line = str(err.value)
    assert "\n" not in line
    assert "hardware=h200x8 plans for 8 CUDA GPU(s) with 141 GB each" in line
    assert "this machine has 42.4 GB per GPU: 8 x NVIDIA A100-SXM4-40GB (42.4 GB, 8.0)" in line
    assert "hardware=local" in line and "launch.allow_mismatch=true" in line
    assert runner.calls == [] and not (run_dir / "launch.sh").exists()
    # Preparing a launch for elsewhere is not starting one here: dry runs and SLURM pass.
    assert (
        stage.run(cfg, run_dir, plan, launch=LaunchConfig(dry_run=True), read_machine=lambda _: eight_a100)
        == 0
    )
    slurm = LaunchConfig(scheduler="slurm")
    assert stage.run(cfg, run_dir, plan, launch=slurm, runner=runner, which=lambda n: None) == 0


def test_allow_mismatch_starts_anyway_and_says_so(run70, capsys):
    cfg, plan, run_dir = run70
    runner = Capture()
    launch = LaunchConfig(allow_mismatch=True)
    assert stage.run(cfg, run_dir, plan, launch=launch, runner=runner, read_machine=lambda _: node(H200)) == 0
    assert len(runner.calls) == 1
    out = capsys.readouterr().out
    assert "note: launch.allow_mismatch=true: starting anyway although hardware=h200x8 plans for 8" in out
    assert "this machine has 1 GPU(s)" in out


def test_more_gpus_than_planned_start_on_the_first_ones(run70, capsys, monkeypatch):
    cfg, plan, run_dir = run70
    sixteen = node(*[H200] * 16)
    runner = Capture()
    stage.run(cfg, run_dir, plan, launch=LaunchConfig(), runner=runner, read_machine=lambda _: sixteen)
    [(argv, env, _)] = runner.calls
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and "--nproc_per_node=8" in argv
    assert "export CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in (run_dir / "launch.sh").read_text()
    assert (
        "this machine has 16 GPUs, the plan uses 8: CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"
        in capsys.readouterr().out
    )
    # A list the user already narrowed is narrowed further, in its own order.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "15,14,13,12,11,10,9,8,7")
    runner = Capture()
    stage.run(
        cfg, run_dir, plan, launch=LaunchConfig(), runner=runner, read_machine=lambda _: node(*[H200] * 9)
    )
    assert runner.calls[0][1]["CUDA_VISIBLE_DEVICES"] == "15,14,13,12,11,10,9,8"


def test_missing_run_dir_files_are_named(tmp_path, llama70b_full):
    cfg, plan = llama70b_full
    with pytest.raises(LaunchError, match="config.yaml: missing"):
        stage.run(cfg, tmp_path, plan, launch=LaunchConfig(dry_run=True), runner=Capture())


# ---------------------------------------------------------------- SLURM


def test_slurm_script_and_submission(run70, capsys):
    cfg, plan, run_dir = run70
    launch = LaunchConfig(
        scheduler="slurm",
        nnodes=2,
        slurm_partition="gpu",
        slurm_account="ml",
        slurm_time="2-00:00:00",
        slurm_cpus_per_task=96,
        master_port=29600,
    )
    runner = Capture()
    assert stage.run(cfg, run_dir, plan, launch=launch, runner=runner, which=lambda n: f"/usr/bin/{n}") == 0
    text = (run_dir / "slurm.sbatch").read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=96",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=ml",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --error={run_dir}/slurm-%j.err",
        "set -euo pipefail",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
    ):
        assert line in text.splitlines(), line
    srun = next(x for x in text.splitlines() if x.startswith("srun "))
    argv = shlex.split(srun)
    assert Path(argv[1]).name == "torchrun"
    assert argv[2:] == [
        "--nnodes", "$SLURM_NNODES", "--nproc_per_node", "8", "--rdzv_id", "$SLURM_JOB_ID",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "$MASTER_ADDR:29600", "-m", "finetune.train", str(run_dir),
    ]  # fmt: skip
    assert runner.calls == [(["/usr/bin/sbatch", str(run_dir / "slurm.sbatch")], {}, str(run_dir))]
    subprocess.run(["bash", "-n", str(run_dir / "slurm.sbatch")], check=True)


def test_slurm_without_sbatch_prints_how_and_dry_run_never_submits(run70, capsys):
    cfg, plan, run_dir = run70
    runner = Capture()
    stage.run(cfg, run_dir, plan, launch=LaunchConfig(scheduler="slurm"), runner=runner, which=lambda n: None)
    assert runner.calls == [] and f"sbatch {run_dir / 'slurm.sbatch'}" in capsys.readouterr().out
    stage.run(
        cfg,
        run_dir,
        plan,
        launch=LaunchConfig(scheduler="slurm", dry_run=True),
        runner=runner,
        which=lambda n: "/usr/bin/sbatch",
    )
    assert runner.calls == []


# ---------------------------------------------------------------- the command line (once stages.py wires it)


@pytest.mark.skipif(
    "launch" not in {f.name for f in dataclasses.fields(Config)},
    reason="Config.launch not wired into stages.py yet",
)
def test_cli_dry_run_llama70b_full(tmp_path):
    r = run_cli(
        "+recipe=llama70b_full",
        "mode=launch",
        "launch.dry_run=true",
        f"run_dir={tmp_path / 'run'}",
        env=child_env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "--nproc_per_node=8" in r.stdout and "DeepSpeed ZeRO-3" in r.stdout and "optimizer" in r.stdout
    assert (tmp_path / "run" / "launch.sh").is_file() and (tmp_path / "run" / "deepspeed.json").is_file()


# ---------------------------------------------------------------- plan.json is the single source after planning


@pytest.mark.parametrize("recipe", ["llama70b_full", "llama70b_lora", "qwen32b_full"])
def test_the_launcher_and_the_ranks_read_the_layout_plan_json_carries(tmp_path, recipe, capsys):
    """The pipeline's plan.json carries the layout; the launcher starts exactly that many ranks, and
    engine.json (what each rank reads) says the same engine and world size."""
    from finetune.pipeline.stages import plan_stage

    cfg = resolve(compose([f"+recipe={recipe}", f"run_dir={tmp_path / 'run'}"]))
    run_dir = rundir.prepare(cfg)
    rundir.save_config(cfg, run_dir)
    plan = plan_stage(cfg, run_dir, quiet=True)
    assert stage.run(cfg, run_dir, plan, launch=replace(cfg.launch, dry_run=True)) == 0
    written = json.loads((run_dir / rundir.PLAN_FILE).read_text())["layout"]
    engine = json.loads((run_dir / rundir.ENGINE_FILE).read_text())
    assert written == plan.layout.to_dict() == rundir.load_plan(run_dir).layout.to_dict()
    assert (engine["engine"], engine["world_size"]) == (written["engine"], written["world_size"])
    assert f"--nproc_per_node={written['processes_per_node']}" in capsys.readouterr().out
    assert engine["trainer_kwargs"]["per_device_train_batch_size"] == plan.strategy.micro_batch_size


def test_hardware_auto_plan_json_carries_the_chosen_profile(tmp_path):
    """Under hardware=auto the ranks read the profile the planner chose (config.yaml keeps `auto`)."""
    from finetune.pipeline.stages import plan_stage

    cfg = resolve(compose(["+recipe=llama70b_lora", "hardware=auto", f"run_dir={tmp_path / 'run'}"]))
    run_dir = rundir.prepare(cfg)
    plan = plan_stage(cfg, run_dir, quiet=True)
    loaded = rundir.load_plan(run_dir)
    assert cfg.hardware.name == "auto" and loaded.hardware.name == plan.hardware.name != "auto"
    assert loaded.hardware == plan.hardware == load_profiles()[plan.hardware.name]
    assert loaded.layout == plan.layout and loaded.layout.nproc_per_node == plan.hardware.gpus_per_node


def test_the_pipeline_runs_the_prechecks_once_and_hands_them_to_the_ranks(run70, monkeypatch):
    """precheck=True (the pipeline): disk, resume and RAM are checked here, before the ranks start, and the
    ranks are told so; launch.sh (run later, elsewhere) carries no such promise."""
    from finetune.rundir import preflight

    cfg, plan, run_dir = run70
    calls = []
    monkeypatch.setattr(stage, "check", lambda *a, **k: calls.append(a[1]))
    runner = Capture()
    assert stage.run(cfg, run_dir, plan, launch=LaunchConfig(), runner=runner, precheck=True) == 0
    [(_, env, _)] = runner.calls
    assert calls == [run_dir] and env[preflight.PRECHECKED_ENV] == "1"
    assert preflight.MISMATCH_ENV not in env
    assert preflight.PRECHECKED_ENV not in (run_dir / "launch.sh").read_text()
    assert preflight.handed_down(env) == preflight.MachineCheck({}) and preflight.handed_down({}) is None
    calls.clear()
    for launch in (LaunchConfig(dry_run=True), LaunchConfig(detach=True)):  # the ranks check for themselves
        runner = Capture()
        stage.run(cfg, run_dir, plan, launch=launch, runner=runner, which=lambda n: None, precheck=True)
        assert calls == [] and all(preflight.PRECHECKED_ENV not in env for _, env, _ in runner.calls)
    with pytest.raises(LaunchError, match="disk: "):  # the real check, on this small disk, before any start
        monkeypatch.setattr(stage, "check", preflight.check)
        stage.run(cfg, run_dir, plan, launch=LaunchConfig(), runner=(runner := Capture()), precheck=True)
    assert runner.calls == []
    mismatch = "hardware=h200x8 plans for 8 CUDA GPU(s) ..."
    handed = preflight.handoff(preflight.MachineCheck({}, mismatch=mismatch))
    assert preflight.handed_down(handed) == preflight.MachineCheck({}, mismatch=mismatch)
