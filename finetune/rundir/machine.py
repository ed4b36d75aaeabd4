"""This machine as torch.cuda and psutil report it: `hardware=local`, and the check that a launch matches its plan.

    python -m finetune +recipe=llama8b_lora hardware=local mode=plan    # will it fit on what I have?

`read_machine` is the one function that asks the hardware (torch.cuda; NVML, when
pynvml is installed, only to say why torch sees no GPU; psutil; the disk). Everything
else takes its `Machine`, a plain description, so tests pass fake machines:

- `local_profile`: the `HardwareConfig` hardware=local plans with. Price and peak
  FLOP/s come from the profile whose GPU this is (`gpu_names` and memory), else stay
  None, and its notes say which;
- `mismatch`: why this machine cannot start a plan (one line), or None;
- `peak_rss_bytes`: this process's own peak resident set (what a CPU run is measured by).

Sizes are decimal GB (1e9 bytes), as the plan counts them. Vendors' "80 GB" is closer
to 80 GiB (an H100 80GB reports about 85.0e9 bytes, 79.2 GiB; an A100 40GB 42.4e9),
so a GPU matches a profile when it has at least `MEMORY_TOLERANCE` less than the
profile's figure and at most that figure in GiB plus the tolerance.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from finetune.core.composition import load_profiles
from finetune.core.config import HardwareConfig

GB = 1e9
GIB_PER_GB = 2**30 / GB
# How much less memory than the plan's figure a GPU may report and still count as that GPU.
MEMORY_TOLERANCE = 0.05
BF16_CAPABILITY = (8, 0)  # Ampere and later run bf16 natively


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM, the high-water mark of its own address space.

    Not getrusage's ru_maxrss: Linux carries the parent's high-water mark into a child across exec, so a
    training process started by a 1.5 GB parent (a long pytest run, a notebook) reports at least 1.5 GB
    however little it uses (measured: 1,514 MB reported by a child whose VmHWM was 13 MB).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # elsewhere (macOS: bytes, not kilobytes)
    return kb if sys.platform == "darwin" else kb * 1024


@dataclass(frozen=True)
class GPU:
    """One CUDA device as torch.cuda.get_device_properties reports it."""

    name: str
    memory_bytes: int
    capability: tuple[int, int]

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    @property
    def bf16(self) -> bool:
        return self.capability >= BF16_CAPABILITY


@dataclass(frozen=True)
class Machine:
    """What this machine reports. No GPUs: `no_gpu_reason` says why (a CPU-only torch, none visible)."""

    gpus: tuple[GPU, ...] = ()
    host_memory_bytes: int = 0
    cpu_count: Optional[int] = None
    disk_free_bytes: Optional[int] = None
    disk_path: Optional[str] = None
    no_gpu_reason: str = "torch.cuda.is_available() is False"


@dataclass(frozen=True)
class Requirement:
    """What a plan needs of the node it starts on."""

    profile: str  # the plan's hardware name, for the message
    device: str  # cuda | cpu
    gpus: int  # processes (GPUs) on this node
    gpu_memory_gb: Optional[float]
    bf16: bool


# ---------------------------------------------------------------- reading the hardware


def read_machine(run_dir: Optional[Path] = None) -> Machine:
    """This machine, now: torch.cuda's devices (as CUDA_VISIBLE_DEVICES shows them), RAM, CPUs, free disk."""
    import psutil
    import torch

    gpus: tuple[GPU, ...] = ()
    reason = ""
    if torch.cuda.is_available():
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        gpus = tuple(GPU(p.name, int(p.total_memory), (p.major, p.minor)) for p in props)
    elif torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU-only build"
    else:
        reason = "torch.cuda.is_available() is False"
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            reason += f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
    if not gpus:
        seen = _nvml_gpus()
        if seen:
            reason += f"; NVML sees {seen}"
    disk = _existing(Path(run_dir)) if run_dir is not None else None
    return Machine(
        gpus=gpus,
        host_memory_bytes=int(psutil.virtual_memory().total),
        cpu_count=os.cpu_count(),
        disk_free_bytes=shutil.disk_usage(disk).free if disk is not None else None,
        disk_path=str(run_dir) if run_dir is not None else None,
        no_gpu_reason=reason,
    )


def _nvml_gpus() -> str:
    """'8 x NVIDIA H100 80GB HBM3' when pynvml is installed and the driver answers; '' otherwise."""
    try:
        import pynvml  # optional: not a dependency
    except ImportError:
        return ""
    try:
        pynvml.nvmlInit()
        try:
            raw = [
                pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(pynvml.nvmlDeviceGetCount())
            ]
            names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw]  # bytes in older pynvml
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # no driver, or no device: nothing more to say
        return ""
    return describe_names(names)


def _existing(path: Path) -> Path:
    """The run directory, or its nearest parent that exists (the run directory is made later)."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# ---------------------------------------------------------------- hardware=local


def describe_names(names: list[str]) -> str:
    """['A', 'A', 'B'] -> '2 x A, 1 x B'."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} x {name}" for name, n in counts.items())


def memory_matches(detected_gb: float, profile_gb: float) -> bool:
    """A GPU reporting `detected_gb` is a `profile_gb` part (the datasheet's GB may be GiB; see the module doc)."""
    low = profile_gb * (1 - MEMORY_TOLERANCE)
    high = profile_gb * GIB_PER_GB * (1 + MEMORY_TOLERANCE)
    return low <= detected_gb <= high


def matching_profile(
    gpu_name: str, gpu_memory_gb: float, count: int, profiles: Mapping[str, HardwareConfig]
) -> Optional[HardwareConfig]:
    """The profile of this GPU: one with exactly `count` of them per node first, else the smallest node."""
    same = [
        p
        for p in profiles.values()
        if p.device == "cuda"
        and p.gpu_memory_gb is not None
        and gpu_name.strip().lower() in (n.strip().lower() for n in p.gpu_names)
        and memory_matches(gpu_memory_gb, p.gpu_memory_gb)
    ]
    if not same:
        return None
    return min(same, key=lambda p: (p.gpus_per_node != count, p.gpus_per_node, p.name))


def local_profile(
    machine: Machine,
    profiles: Mapping[str, HardwareConfig],
    nodes: int = 1,
    base: Optional[HardwareConfig] = None,
) -> HardwareConfig:
    """The profile hardware=local plans with; `base` is the composed `hardware` (a price the user set is kept)."""
    base = base or HardwareConfig(name="local", device="cuda")
    ram_gb = round(machine.host_memory_bytes / GB, 2)
    disk_gb = None if machine.disk_free_bytes is None else round(machine.disk_free_bytes / GB, 2)
    host = f"host RAM {ram_gb:,.1f} GB" + (f", {machine.cpu_count} vCPUs" if machine.cpu_count else "")
    if disk_gb is not None:
        host += f", {disk_gb:,.1f} GB free under {machine.disk_path}"
    local = replace(
        base, nodes=nodes, host_memory_gb=ram_gb, vcpus=machine.cpu_count, disk_free_gb=disk_gb, candidates=[]
    )
    if not machine.gpus:
        return replace(
            local,
            device="cpu",
            gpus_per_node=1,
            gpu_memory_gb=ram_gb,  # RAM stands in for GPU memory, as hardware=cpu does
            hbm_tb_per_s=None,
            local_nvme_tb=None,
            interconnect=None,
            gpu_names=[],
            notes=[
                f"hardware=local: no CUDA GPU on this machine ({machine.no_gpu_reason}); planning for the CPU "
                f"as hardware=cpu does ({ram_gb:,.1f} GB of RAM stands in for GPU memory); {host}"
            ],
        )

    count = len(machine.gpus)
    smallest = min(machine.gpus, key=lambda g: g.memory_bytes)
    names = list(dict.fromkeys(g.name for g in machine.gpus))
    capability = min(g.capability for g in machine.gpus)
    memory_gb = round(smallest.memory_gb, 2)
    mixed = len({g.memory_bytes for g in machine.gpus}) > 1
    notes = [
        f"hardware=local: {describe_names([g.name for g in machine.gpus])} read by torch.cuda, "
        f"{memory_gb:,.2f} GB ({smallest.memory_bytes / 2**30:,.2f} GiB) per GPU{' (the smallest)' if mixed else ''}, "
        f"compute capability {capability[0]}.{capability[1]}; {host}; {nodes} node(s) from launch.nnodes"
        + (", each assumed to be like this one" if nodes > 1 else "")
    ]
    if capability < BF16_CAPABILITY:
        notes.append(
            f"no bf16 on compute capability {capability[0]}.{capability[1]} (needs 8.0): a bf16 plan is refused "
            "at launch; set method.precision=fp32 (and method.compute_dtype=fp32 for QLoRA)"
        )
    match = matching_profile(names[0], memory_gb, count, profiles) if len(names) == 1 else None
    price, peak = base.usd_per_month, base.peak_bf16_tflops
    if match is None:
        why = (
            "the GPUs differ"
            if len(names) > 1
            else f"no profile's GPU is {names[0]} with {memory_gb:,.1f} GB"
        )
        notes.append(f"{why}: price and peak FLOP/s unknown (null) unless set (hardware.usd_per_month, ...)")
    else:
        peak = match.peak_bf16_tflops if peak is None else peak
        if price is None and match.usd_per_month is not None:
            price = round(match.usd_per_month * count / match.gpus_per_node, 2)
        notes.append(_price_note(match, count, base, price, peak))
    return replace(
        local,
        device="cuda",
        gpus_per_node=count,
        gpu_memory_gb=memory_gb,
        hbm_tb_per_s=match.hbm_tb_per_s if match else None,
        peak_bf16_tflops=peak,
        local_nvme_tb=None,
        # NVLink or PCIe is a fact of the node: known only when the profile is this very node.
        interconnect=match.interconnect if match and match.gpus_per_node == count else None,
        usd_per_month=price,
        gpu_names=names,
        notes=notes,
    )


def _price_note(
    match: HardwareConfig, count: int, base: HardwareConfig, price: Optional[float], peak: Optional[float]
) -> str:
    if base.usd_per_month is not None:
        price_text = f"price {price:,.0f} USD/month from hardware.usd_per_month"
    elif match.usd_per_month is None:
        price_text = f"price unknown (null in {match.name})"
    elif match.gpus_per_node == count:
        price_text = f"price {price:,.0f} USD/month"
    else:
        price_text = (
            f"price {price:,.0f} USD/month = {count} GPU(s) at {match.name}'s "
            f"{match.usd_per_month / match.gpus_per_node:,.0f} USD/month per GPU"
        )
    if base.peak_bf16_tflops is not None:
        peak_text = f"peak {peak:,.0f} TFLOP/s from hardware.peak_bf16_tflops"
    elif peak is None:
        peak_text = f"peak FLOP/s unknown (null in {match.name}): no time estimate"
    else:
        peak_text = f"dense bf16 peak {peak:,.0f} TFLOP/s per GPU"
    return f"this GPU is {match.name}'s: {price_text}, {peak_text}"


def resolve_local(
    hw: HardwareConfig,
    nodes: int,
    run_dir: Path,
    *,
    read: Optional[Callable[[Optional[Path]], Machine]] = None,
    profiles: Optional[Mapping[str, HardwareConfig]] = None,
) -> HardwareConfig:
    """hardware=local, not yet read (no gpu_memory_gb): this machine's profile. Anything else: `hw` as is."""
    if hw.name != "local" or hw.gpu_memory_gb is not None:
        return hw
    if profiles is None:
        profiles = load_profiles()
    return local_profile((read or read_machine)(run_dir), profiles, nodes, base=hw)


def resolve_host_hardware(hw: HardwareConfig) -> HardwareConfig:
    """`hardware=cpu`: the memory and cores of this machine, read now (RAM stands in for GPU memory)."""
    if hw.device != "cpu":
        return hw
    import psutil

    ram_gb = psutil.virtual_memory().total / 1e9
    return replace(
        hw,
        gpu_memory_gb=hw.gpu_memory_gb or round(ram_gb, 2),
        host_memory_gb=hw.host_memory_gb or round(ram_gb, 2),
        vcpus=hw.vcpus or os.cpu_count(),
    )


# ---------------------------------------------------------------- does this machine run the plan?


def mismatch(req: Requirement, machine: Machine) -> Optional[str]:
    """One line naming what the plan needs, what this machine has, and how to plan for it; None when it matches."""
    if req.device != "cuda":
        return None
    need = f"{req.gpus} CUDA GPU(s)"
    if req.gpu_memory_gb is not None:
        need += f" with {req.gpu_memory_gb:g} GB each"
    if req.bf16:
        need += " that run bf16 (compute capability 8.0 or later)"
    gpus = machine.gpus
    fixes = ["hardware=local (python -m finetune ... hardware=local mode=plan)"]
    if not gpus:
        has = f"this machine has no CUDA GPU ({machine.no_gpu_reason})"
    else:
        problems = []
        if len(gpus) < req.gpus:
            problems.append(f"{len(gpus)} GPU(s)")
        if req.gpu_memory_gb is not None:
            small = [g for g in gpus[: req.gpus] if g.memory_gb < req.gpu_memory_gb * (1 - MEMORY_TOLERANCE)]
            if small:
                problems.append(f"{min(g.memory_gb for g in small):,.1f} GB per GPU")
        if req.bf16 and not all(g.bf16 for g in gpus[: req.gpus]):
            worst = min(g.capability for g in gpus[: req.gpus])
            problems.append(f"compute capability {worst[0]}.{worst[1]} (no bf16)")
            fixes.append("method.precision=fp32 (and method.compute_dtype=fp32 for QLoRA)")
        if not problems:
            return None
        has = f"this machine has {', '.join(problems)}: {describe_gpus(gpus)}"
    return (
        f"hardware={req.profile} plans for {need}; {has}; plan for this machine with {' plus '.join(fixes)}, "
        "or set launch.allow_mismatch=true to start anyway"
    )


def describe_gpus(gpus: tuple[GPU, ...]) -> str:
    """'2 x NVIDIA A100-SXM4-80GB (85.1 GB, 8.0)'."""
    groups: dict[GPU, int] = {}
    for g in gpus:
        groups[g] = groups.get(g, 0) + 1
    return ", ".join(
        f"{n} x {g.name} ({g.memory_gb:,.1f} GB, {g.capability[0]}.{g.capability[1]})"
        for g, n in groups.items()
    )


def visible_devices(count: int, environ: Mapping[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES for the first `count` GPUs this process sees (of an existing list, if one is set)."""
    current = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in current.split(",") if x.strip()] if current else [str(i) for i in range(count)]
    return ",".join(ids[:count])
