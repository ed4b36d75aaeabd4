"""The plan contract (DESIGN.md): the strategy, the memory terms, the estimate, and the frozen `Plan`.

Sizes are decimal GB (1e9 bytes), per GPU unless named otherwise. `Plan.to_dict` is
plan.json; workers read it back with `Plan.from_dict` and never re-plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from finetune.config import HardwareConfig

GB = 1e9


@dataclass(frozen=True)
class Strategy:
    """How the job runs. The engine is the sharding's (finetune/planner/engines.py says what each one runs)."""

    sharding: str = "none"  # none | ddp | fsdp | zero3
    offload_optimizer: bool = False
    offload_params: bool = False
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    chunked_loss: bool = False
    micro_batch_size: int = 1
    grad_accum_steps: int = 1


@dataclass(frozen=True)
class Memory:
    """Per-GPU terms in GB. `logits` is the loss's peak (the contract's name): the trainer's loss paths never
    build the whole logits, but a chunk or a tile of them, and their gradient buffers."""

    weights: float
    trainable_state: float
    activations: float
    logits: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.trainable_state + self.activations + self.logits + self.overhead

    def as_dict(self) -> dict[str, float]:
        d = {k: round(v, 3) for k, v in asdict(self).items()}
        d["total"] = round(self.total, 3)
        return d


@dataclass(frozen=True)
class Estimate:
    tokens_per_second: Optional[float]
    step_seconds: Optional[float]
    run_hours: Optional[float]
    usd: Optional[float]


@dataclass(frozen=True)
class Alternative:
    hardware: str
    fits: bool
    total_gb: float
    usd_per_month: Optional[float]


@dataclass(frozen=True)
class Plan:
    fits: bool
    hardware: HardwareConfig
    params_total: int
    params_trainable: int
    strategy: Strategy
    gpu_memory: Memory
    host_memory_gb: float
    disk_checkpoint_gb: float
    disk_export_gb: float
    estimate: Estimate
    seq_len: int
    reasons: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    usable_gpu_memory_gb: float = 0.0
    merge_host_memory_gb: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The plan contract of DESIGN.md (sizes in decimal GB, per GPU unless named otherwise)."""
        hw = self.hardware
        return {
            "fits": self.fits,
            "hardware": {
                "name": hw.name,
                "gpus": hw.total_gpus,
                "gpu_memory_gb": hw.gpu_memory_gb,
                "host_memory_gb": hw.host_memory_gb,
                "usd_per_month": hw.usd_per_month,
            },
            "params": {"total": self.params_total, "trainable": self.params_trainable},
            "strategy": asdict(self.strategy),
            "gpu_memory_gb": self.gpu_memory.as_dict(),
            "host_memory_gb": round(self.host_memory_gb, 3),
            "disk_gb": {
                "checkpoint": round(self.disk_checkpoint_gb, 3),
                "export": round(self.disk_export_gb, 3),
            },
            "estimate": {k: (None if v is None else round(v, 4)) for k, v in asdict(self.estimate).items()},
            "reasons": list(self.reasons),
            "suggestions": list(self.suggestions),
            "alternatives": [asdict(a) for a in self.alternatives],
            "seq_len": self.seq_len,
            "usable_gpu_memory_gb": round(self.usable_gpu_memory_gb, 3),
            "merge_host_memory_gb": round(self.merge_host_memory_gb, 3),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], hardware: HardwareConfig) -> Plan:
        """`to_dict`'s output back into a Plan (workers read plan.json; they never re-plan).

        The contract names the profile but not all of it, so the caller passes the resolved profile.
        """
        return cls(
            fits=d["fits"],
            hardware=hardware,
            params_total=d["params"]["total"],
            params_trainable=d["params"]["trainable"],
            strategy=Strategy(**d["strategy"]),
            gpu_memory=Memory(**{k: v for k, v in d["gpu_memory_gb"].items() if k != "total"}),
            host_memory_gb=d["host_memory_gb"],
            disk_checkpoint_gb=d["disk_gb"]["checkpoint"],
            disk_export_gb=d["disk_gb"]["export"],
            estimate=Estimate(**d["estimate"]),
            seq_len=d["seq_len"],
            reasons=tuple(d.get("reasons", ())),
            suggestions=tuple(d.get("suggestions", ())),
            alternatives=tuple(Alternative(**a) for a in d.get("alternatives", ())),
            usable_gpu_memory_gb=d.get("usable_gpu_memory_gb", 0.0),
            merge_host_memory_gb=d.get("merge_host_memory_gb", 0.0),
        )
