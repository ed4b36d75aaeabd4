"""hardware=local and the launch check, on fake machines (what torch.cuda would report), and on this one."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import pytest
from helpers import SHORT_RUN, child_env, run_cli, train_run

from finetune import rundir
from finetune.core.composition import compose, load_profiles
from finetune.core.errors import LaunchError
from finetune.planner import Plan, make_plan
from finetune.planner.contract import CONTRACT_HARDWARE
from finetune.rundir import machine, preflight
from finetune.rundir.machine import GPU, Machine, Requirement, local_profile, mismatch

PROFILES = load_profiles()
# Device names and total_memory bytes as torch.cuda.get_device_properties reports them.
H100 = GPU("NVIDIA H100 80GB HBM3", 85_029_158_912, (9, 0))
H100_PCIE = GPU("NVIDIA H100 PCIe", 85_029_158_912, (9, 0))
A100_80 = GPU("NVIDIA A100-SXM4-80GB", 85_097_971_712, (8, 0))
A100_40 = GPU("NVIDIA A100-SXM4-40GB", 42_405_855_232, (8, 0))
GH200_144 = GPU("NVIDIA GH200 144G HBM3e", 153_008_209_920, (9, 0))
V100 = GPU("Tesla V100-SXM2-32GB", 34_089_730_048, (7, 0))


def box(*gpus: GPU, ram_gb: int = 1000, disk_gb: int = 3000) -> Machine:
    return Machine(
        gpus=gpus,
        host_memory_bytes=ram_gb * 10**9,
        cpu_count=64,
        disk_free_bytes=disk_gb * 10**9,
        disk_path="/nvme/runs/x",
        no_gpu_reason="torch 2.13.0+cpu is a CPU-only build",
    )


# ---------------------------------------------------------------- hardware=local


def test_two_a100_80gb_plan_with_detected_memory_and_the_a100_profiles_facts():
    hw = local_profile(box(A100_80, A100_80), PROFILES)
    assert (hw.name, hw.device, hw.gpus_per_node, hw.nodes) == ("local", "cuda", 2, 1)
    assert hw.gpu_memory_gb == 85.1  # decimal GB of the smaller GPU, as the planner counts
    assert (hw.host_memory_gb, hw.vcpus, hw.disk_free_gb) == (1000.0, 64, 3000.0)
    assert (hw.peak_bf16_tflops, hw.hbm_tb_per_s) == (312, 2.039)  # from a100_80gb
    assert hw.usd_per_month is None  # a100_80gb has no known price: none is invented
    assert hw.interconnect is None  # a100_80gb is one GPU: how these two are linked is unknown
    assert hw.gpu_names == ["NVIDIA A100-SXM4-80GB"]
    assert hw.notes[0].startswith("hardware=local: 2 x NVIDIA A100-SXM4-80GB read by torch.cuda, 85.10 GB")
    assert "compute capability 8.0" in hw.notes[0] and "3,000.0 GB free under /nvme/runs/x" in hw.notes[0]
    assert hw.notes[1] == (
        "this GPU is a100_80gb's: price unknown (null in a100_80gb), dense bf16 peak 312 TFLOP/s per GPU"
    )

    cfg = compose(["model=llama3_1_8b", "method=lora", "train.seq_len=4096", "train.max_steps=100"])
    plan = make_plan(cfg.model, cfg.method, hw, cfg.train, cfg.plan, PROFILES)
    d = plan.to_dict()["hardware"]
    assert {k: d[k] for k in CONTRACT_HARDWARE} == {
        "name": "local",
        "gpus": 2,
        "gpu_memory_gb": 85.1,
        "host_memory_gb": 1000.0,
        "usd_per_month": None,
    }
    # the whole profile read from the machine, not `local`'s YAML: what the ranks run with
    assert (d["device"], d["gpus_per_node"], d["gpu_names"], d["peak_bf16_tflops"]) == (
        "cuda",
        2,
        ["NVIDIA A100-SXM4-80GB"],
        312,
    )
    assert Plan.from_dict(plan.to_dict()).hardware == hw
    assert plan.usable_gpu_memory_gb == pytest.approx(85.1 * (1 - cfg.plan.headroom))
    assert plan.estimate.tokens_per_second is not None and plan.estimate.usd is None


def test_a_whole_node_takes_its_price_one_gpu_of_it_scales_the_per_gpu_price():
    eight = local_profile(box(*[H100] * 8), PROFILES)
    assert (eight.usd_per_month, eight.interconnect, eight.peak_bf16_tflops) == (16900, "nvlink", 989)
    assert "this GPU is h100x8's: price 16,900 USD/month" in eight.notes[-1]
    two = local_profile(box(H100, H100), PROFILES)
    assert (two.usd_per_month, two.interconnect) == (2 * 2190, None)
    assert "price 4,380 USD/month = 2 GPU(s) at h100's 2,190 USD/month per GPU" in two.notes[-1]
    cfg = compose(["model=llama3_1_8b", "method=lora", "train.seq_len=4096", "train.max_steps=100"])
    plan = make_plan(cfg.model, cfg.method, two, cfg.train, cfg.plan, PROFILES)
    assert plan.estimate.usd == pytest.approx(plan.estimate.run_hours * 4380 / 730)


def test_a_price_the_user_sets_is_kept():
    hw = local_profile(
        box(A100_80), PROFILES, base=replace(compose(["hardware=local"]).hardware, usd_per_month=1500)
    )
    assert hw.usd_per_month == 1500 and hw.peak_bf16_tflops == 312
    assert "price 1,500 USD/month from hardware.usd_per_month" in hw.notes[-1]


@pytest.mark.parametrize(
    "gpus, why",
    [
        ((V100,), "no profile's GPU is Tesla V100-SXM2-32GB with 34.1 GB"),
        (
            (H100_PCIE,),
            "no profile's GPU is NVIDIA H100 PCIe",
        ),  # not h100's SXM part: other peak and bandwidth
        ((A100_80, A100_40), "the GPUs differ"),
    ],
)
def test_a_gpu_no_profile_describes_has_unknown_price_and_peak(gpus, why):
    hw = local_profile(box(*gpus), PROFILES)
    assert hw.usd_per_month is None and hw.peak_bf16_tflops is None and hw.hbm_tb_per_s is None
    assert hw.notes[-1].startswith(why) and "price and peak FLOP/s unknown (null)" in hw.notes[-1]
    assert hw.gpu_memory_gb == round(min(g.memory_bytes for g in gpus) / 1e9, 2)


def test_memory_tells_the_two_gh200_parts_apart():
    assert machine.matching_profile(GH200_144.name, GH200_144.memory_gb, 1, PROFILES).name == "gh200_144gb"
    assert machine.matching_profile(GH200_144.name, 102.0, 1, PROFILES) is None  # not a 144 GB part
    assert machine.memory_matches(85.03, 80) and machine.memory_matches(76.0, 80)
    assert not machine.memory_matches(75.9, 80) and not machine.memory_matches(90.3, 80)
    assert machine.memory_matches(42.41, 40) and not machine.memory_matches(42.41, 80)


def test_a_gpu_without_bf16_is_planned_and_told_what_will_happen():
    hw = local_profile(box(V100), PROFILES)
    assert hw.gpus_per_node == 1 and hw.gpu_memory_gb == 34.09
    assert any("no bf16 on compute capability 7.0" in n and "method.precision=fp32" in n for n in hw.notes)


def test_no_cuda_plans_for_the_cpu_as_hardware_cpu_does():
    hw = local_profile(box(ram_gb=24), PROFILES, nodes=1)
    assert (hw.device, hw.gpus_per_node, hw.gpu_memory_gb, hw.host_memory_gb) == ("cpu", 1, 24.0, 24.0)
    assert hw.notes == [
        "hardware=local: no CUDA GPU on this machine (torch 2.13.0+cpu is a CPU-only build); planning for "
        "the CPU as hardware=cpu does (24.0 GB of RAM stands in for GPU memory); host RAM 24.0 GB, 64 vCPUs, "
        "3,000.0 GB free under /nvme/runs/x"
    ]


def test_local_is_read_once_then_travels_in_config_yaml(tmp_path, monkeypatch):
    """The driver reads the machine at plan time; the worker reads the resolved profile back, it does not re-detect."""
    from finetune.pipeline.stages import resolve

    reads = []

    def fake(run_dir):
        reads.append(run_dir)
        return box(H100, H100)

    monkeypatch.setattr("finetune.rundir.machine.read_machine", fake)
    cfg = resolve(compose(["+recipe=tiny", "hardware=local", "launch.nnodes=2", f"run_dir={tmp_path}"]))
    assert reads == [tmp_path] and (cfg.hardware.gpus_per_node, cfg.hardware.nodes) == (2, 2)
    assert "2 node(s) from launch.nnodes, each assumed to be like this one" in cfg.hardware.notes[0]
    rundir.save_config(cfg, tmp_path)
    again = resolve(rundir.load_config(tmp_path))
    assert reads == [tmp_path] and again.hardware == cfg.hardware
    named = compose(["+recipe=tiny", "hardware=h100"]).hardware
    assert machine.resolve_local(named, 1, tmp_path, read=fake) is named


# ---------------------------------------------------------------- does this machine run the plan?


def need(gpus: int = 1, memory: float = 80, bf16: bool = True) -> Requirement:
    return Requirement("h100", "cuda", gpus, memory, bf16)


def test_no_cuda_is_refused_in_one_line_naming_need_have_and_the_fix():
    assert mismatch(need(), box()) == (
        "hardware=h100 plans for 1 CUDA GPU(s) with 80 GB each that run bf16 (compute capability 8.0 or later); "
        "this machine has no CUDA GPU (torch 2.13.0+cpu is a CPU-only build); plan for this machine with "
        "hardware=local (python -m finetune ... hardware=local mode=plan), or set launch.allow_mismatch=true "
        "to start anyway"
    )


def test_too_few_gpus_too_little_memory_no_bf16():
    few = mismatch(need(gpus=8), box(H100, H100))
    assert "plans for 8 CUDA GPU(s)" in few and "this machine has 2 GPU(s): 2 x NVIDIA H100 80GB HBM3" in few
    small = mismatch(need(), box(A100_40))
    assert "this machine has 42.4 GB per GPU: 1 x NVIDIA A100-SXM4-40GB (42.4 GB, 8.0)" in small
    old = mismatch(need(memory=32), box(V100))
    assert "this machine has compute capability 7.0 (no bf16)" in old
    assert (
        "hardware=local (python -m finetune ... hardware=local mode=plan) plus method.precision=fp32" in old
    )
    assert all("\n" not in m for m in (few, small, old))


def test_what_matches_passes_within_the_memory_tolerance():
    assert mismatch(need(), box(H100)) is None  # 85.0 GB for the 80 of the datasheet
    assert mismatch(need(), box(GPU("H100 reported in GiB", 79_600_000_000, (9, 0)))) is None
    assert mismatch(need(), box(GPU("too small", 75_000_000_000, (9, 0)))) is not None
    assert mismatch(need(memory=32, bf16=False), box(V100)) is None  # an fp32 plan runs on a V100
    assert mismatch(need(gpus=2), box(*[H100] * 8)) is None  # more GPUs than planned: the first two
    assert mismatch(Requirement("cpu", "cpu", 1, 24, False), box()) is None


def test_check_machine_refuses_allows_and_narrows(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = compose(["model=llama3_1_8b", "method=lora", "hardware=h100", "train.seq_len=4096"])
    plan = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES)
    kw = {"gpus": 1, "device": "cuda", "allow_mismatch": False}
    with pytest.raises(LaunchError, match="no CUDA GPU"):
        preflight.check_machine(cfg, plan, **kw, read=lambda _: box())
    allowed = preflight.check_machine(cfg, plan, **{**kw, "allow_mismatch": True}, read=lambda _: box())
    assert allowed.env == {} and allowed.mismatch.startswith(
        "hardware=h100 plans for 1 CUDA GPU(s) with 80 GB"
    )
    wide = preflight.check_machine(cfg, plan, **kw, read=lambda _: box(*[H100] * 4))
    assert wide.env == {"CUDA_VISIBLE_DEVICES": "0"} and wide.mismatch is None
    assert wide.notes == ("this machine has 4 GPUs, the plan uses 1: CUDA_VISIBLE_DEVICES=0",)
    cpu = preflight.check_machine(cfg, plan, **{**kw, "device": "cpu"}, read=lambda _: pytest.fail("read"))
    assert cpu.env == {} and cpu.mismatch is None


# ---------------------------------------------------------------- this machine, for real


# A CUDA plan trained on the CPU anyway: the trainer asks to pin memory for a GPU that is not there.
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator:UserWarning")
def test_this_cpu_machine_refuses_a_gpu_plan_and_allow_mismatch_is_logged(tmp_path, tiny_data):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = ["+recipe=tiny", "hardware=h100", f"run_dir={tmp_path / 'run'}", *SHORT_RUN]
    args += ["train.max_steps=2", "train.save_steps=1000"]
    # fp32: a bf16 CUDA plan forced onto a CPU is refused by transformers itself (no bf16 "GPU" here)
    args += ["method.precision=fp32"]
    with pytest.raises(
        LaunchError,
        match=r"hardware=h100 plans for 1 CUDA GPU\(s\) with 80 GB each; this machine has no CUDA GPU",
    ):
        train_run(compose(args), tiny_data, n_train=8, n_eval=4, max_generate=2)
    assert (
        not (tmp_path / "run" / "metrics.json").exists() and not (tmp_path / "run" / "checkpoints").exists()
    )

    metrics = train_run(
        compose([*args, "launch.allow_mismatch=true"]), tiny_data, n_train=8, n_eval=4, max_generate=2
    )
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())["train"]
    assert metrics["train"]["steps"] == 2
    assert written["machine_mismatch"].startswith("hardware=h100 plans for 1 CUDA GPU(s) with 80 GB each;")
    assert "this machine has no CUDA GPU" in written["machine_mismatch"]


def test_read_machine_here(tmp_path):

    import psutil
    import torch

    here = machine.read_machine(tmp_path / "not" / "yet")
    assert here.host_memory_bytes == psutil.virtual_memory().total and here.cpu_count == os.cpu_count()
    assert here.disk_free_bytes is not None and here.disk_free_bytes > 0  # the nearest folder that exists
    assert len(here.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not here.gpus and torch.version.cuda is None:
        assert here.no_gpu_reason.startswith(f"torch {torch.__version__} is a CPU-only build")


def test_visible_devices():
    assert machine.visible_devices(2, {}) == "0,1"
    assert machine.visible_devices(2, {"CUDA_VISIBLE_DEVICES": "3, 5,7"}) == "3,5"
    assert machine.visible_devices(1, {"CUDA_VISIBLE_DEVICES": "GPU-a1b2,GPU-c3d4"}) == "GPU-a1b2"


def test_the_command_line_refuses_gpu_plans_on_this_cpu_machine(tmp_path):
    """The issue's two commands: exit 2, one line on stderr, nothing trained or started; a dry run still works."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    where = dict(cwd=tmp_path, env=child_env(), timeout=300)
    one = run_cli("+recipe=tiny", "hardware=h100", "mode=train", f"run_dir={tmp_path / 'one'}", **where)
    eight = run_cli(
        "+recipe=tiny", "hardware=h100x8", "mode=launch", f"run_dir={tmp_path / 'eight'}", **where
    )
    for r, gpus in ((one, 1), (eight, 8)):
        assert r.returncode == 2, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert lines[0].startswith(
            f"finetune: error: hardware=h100{'x8' if gpus == 8 else ''} plans for {gpus} "
        )
        assert "this machine has no CUDA GPU" in lines[0] and "hardware=local" in lines[0]
    for run in (tmp_path / "one", tmp_path / "eight"):
        left = {p.name for p in run.iterdir()}
        assert left <= {"config.yaml", "plan.json", ".lock", rundir.OWNER_FILE, rundir.RESUME_FILE}, (
            left
        )  # no launch.sh, checkpoints, metrics
    dry = run_cli(
        "+recipe=tiny", "hardware=h100x8", "mode=launch", "launch.dry_run=true", f"run_dir={tmp_path / 'dry'}",
        **where,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "--nproc_per_node=8" in dry.stdout and (tmp_path / "dry" / "launch.sh").is_file()


def test_a_cpu_only_torch_beside_real_gpus_is_named(monkeypatch, tmp_path):
    """pynvml (optional) says what torch cannot see: the fix is a CUDA build of torch, not another machine."""
    import types

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    fake = types.ModuleType("pynvml")
    fake.NVMLError = type("NVMLError", (Exception,), {})  # type: ignore[attr-defined]
    fake.nvmlInit = fake.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert machine.read_machine(tmp_path).no_gpu_reason.endswith("; NVML sees 2 x NVIDIA H100 80GB HBM3")


def test_a_child_process_reports_its_own_peak_memory_not_its_parents():
    """A CPU run is measured by its own high-water mark: ru_maxrss would carry the parent's across exec."""
    import subprocess

    ballast = bytearray(400 * 2**20)  # 400 MiB in this (parent) process, every page touched
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    code = "from finetune.rundir import machine; print(machine.peak_rss_bytes())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True
    )
    child_peak = int(out.stdout.strip())
    assert (
        1e6 < child_peak < 200 * 2**20
    )  # the child's interpreter and imports, far below the parent's ballast
    assert machine.peak_rss_bytes() > len(ballast)  # and the parent's own mark does count its ballast
    del ballast
