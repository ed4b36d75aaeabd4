"""Schema of the `hardware` config group: one GPU profile, or what was read from this machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from finetune.core.config.checks import check_choices, check_positive, choice

# Hours in a month of rent, for prices quoted per month (730: 8,760 hours a year / 12).
HOURS_PER_MONTH = 730.0


@dataclass
class HardwareConfig:
    """One GPU profile (configs/hardware/*.yaml; planner/MEMORY_MODEL.md, "Hardware profiles"). Facts a vendor
    does not publish stay None."""

    name: str = "cpu"
    device: str = choice("cpu", ("cuda", "cpu"))
    gpus_per_node: int = 1
    nodes: int = 1
    # None for `cpu`: read from the machine at run time; for `auto`: chosen by the planner.
    gpu_memory_gb: Optional[float] = None
    hbm_tb_per_s: Optional[float] = None
    peak_bf16_tflops: Optional[float] = None
    host_memory_gb: Optional[float] = None
    vcpus: Optional[int] = None
    local_nvme_tb: Optional[float] = None
    interconnect: Optional[str] = None  # nvlink | pcie | None
    # The price of one node (gpus_per_node GPUs) a month; null: unknown (no cost estimate, not ranked by
    # hardware=auto).
    usd_per_month: Optional[float] = None
    # The price as rentals quote it, per GPU-hour: when set, it sets usd_per_month (x gpus_per_node x 730 h).
    usd_per_gpu_hour: Optional[float] = None
    # hardware=auto: the profiles to choose from, cheapest that fits wins.
    candidates: list[str] = field(default_factory=list)
    # What torch.cuda.get_device_name() reports for this profile's GPU (hardware=local matches on it
    # and on memory); for hardware=local, the names detected.
    gpu_names: list[str] = field(default_factory=list)
    # hardware=local: free disk under the run directory, and what was detected or left unknown (plan reasons).
    disk_free_gb: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choices(self, "hardware")
        check_positive("hardware.gpus_per_node", self.gpus_per_node)
        check_positive("hardware.nodes", self.nodes)
        check_positive("hardware.gpu_memory_gb", self.gpu_memory_gb, allow_none=True)
        check_positive("hardware.host_memory_gb", self.host_memory_gb, allow_none=True)
        check_positive("hardware.peak_bf16_tflops", self.peak_bf16_tflops, allow_none=True)
        check_positive("hardware.usd_per_month", self.usd_per_month, allow_none=True, allow_zero=True)
        check_positive("hardware.usd_per_gpu_hour", self.usd_per_gpu_hour, allow_none=True, allow_zero=True)
        if self.usd_per_gpu_hour is not None:
            self.usd_per_month = round(self.usd_per_gpu_hour * self.gpus_per_node * HOURS_PER_MONTH, 2)

    @property
    def gpu_hour_usd(self) -> Optional[float]:
        """USD per GPU-hour, from the monthly price of a node; None where the price is unknown."""
        if self.usd_per_month is None:
            return None
        return self.usd_per_month / self.gpus_per_node / HOURS_PER_MONTH

    @property
    def is_auto(self) -> bool:
        return self.name == "auto"

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes
