"""The plan contract (MEMORY_MODEL.md): the strategy, memory terms, estimate, layout, the frozen `Plan`.

Sizes are decimal GB (1e9 bytes), per GPU unless named otherwise. `Plan.to_dict` is
plan.json; workers read it back with `Plan.from_dict` and never re-plan. After the
contract's fields, plan.json carries the whole chosen hardware profile (every
`HardwareConfig` field: under hardware=auto or local, the profile chosen or read,
not `auto`) and the process layout (nodes, processes per node, world size, engine),
so what runs later reads them instead of deriving them again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Optional

from finetune.core.config import HardwareConfig
from finetune.core.errors import PlanError
from finetune.core.parallelism import (
    ENGINES,
    REPLICATED,
    SEQUENCE_SPLITS,
    SINGLE,
    Engine,
    Mesh,
    SequenceSplit,
)

# plan.json's hardware block: the contract's five fields first, then the rest of the profile.
CONTRACT_HARDWARE = ("name", "gpus", "gpu_memory_gb", "host_memory_gb", "usd_per_month")

GB = 1e9


@dataclass(frozen=True)
class Strategy:
    """How the job runs. `sharding` names the engine (a key of finetune/core/parallelism.py's ENGINES)."""

    sharding: str = SINGLE
    offload_optimizer: bool = False
    offload_params: bool = False
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    chunked_loss: bool = False
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    # Objectives with a reference model under full fine-tuning (DPO): its log-probabilities computed once
    # before training (TRL's precompute_ref_log_probs) instead of a frozen copy beside the policy.
    precompute_reference: bool = False
    # Ranks each sequence is split over, and how (a key of SEQUENCE_SPLITS; read only when the degree is > 1).
    sequence_parallel: int = 1
    sequence_split: str = "ulysses"
    # The checkpointed layer inputs kept in host memory (TRL's activation_offloading).
    activation_offloading: bool = False
    # The attention implementation (train.attention's names: sdpa, flex, flash, eager), chosen with the split
    # (finetune/planner/attention.py); the ranks load the model with it.
    attention: str = "sdpa"

    @property
    def engine(self) -> Engine:
        return ENGINES[self.sharding]

    @property
    def split(self) -> Optional[SequenceSplit]:
        """The sequence split, or None when each sequence stays on one rank."""
        return SEQUENCE_SPLITS[self.sequence_split] if self.sequence_parallel > 1 else None

    def mesh(self, world: int) -> Mesh:
        """How the engine divides `world` ranks."""
        return Mesh.of(self.engine, world, self.sequence_parallel)


@dataclass(frozen=True)
class Layout:
    """Where the ranks run: processes per node x nodes on one kind of device, the engine the strategy's
    sharding names, and how it divides the ranks (the mesh)."""

    strategy: Strategy
    nproc_per_node: int
    nnodes: int
    device: str  # cuda | cpu

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def engine(self) -> Engine:
        """The strategy's engine; unsharded, data parallel on several processes and one process on one."""
        engine = self.strategy.engine
        if engine.shards:
            return engine
        return ENGINES[REPLICATED if self.world_size > 1 else SINGLE]

    @property
    def mesh(self) -> Mesh:
        return Mesh.of(self.engine, self.world_size, self.strategy.sequence_parallel)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nnodes,
            "processes_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "engine": self.engine.runs_as,
        }


@dataclass(frozen=True)
class Memory:
    """Per-GPU terms in GB. `logits` is the loss's peak (the contract's name): the trainer's loss paths never
    build the whole logits, but a chunk or a tile of them, and their gradient buffers. `attention` is the
    attention path's workspace (finetune/planner/attention.py): SDPA's [T, T] mask biases in the backward
    above the loss peak, FlexAttention's block mask."""

    weights: float
    trainable_state: float
    activations: float
    logits: float
    attention: float
    overhead: float
    # A vision-language model's encoder activations (finetune/planner/step.py's `vision_activations`); 0 without
    # an image side, and then left out of the plan's table.
    vision_activations: float = 0.0
    # The frozen companion models' terms (finetune/planner/companions.py): ("companion:ROLE", GB) each.
    companions: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.trainable_state
            + self.activations
            + self.logits
            + self.attention
            + self.overhead
            + self.vision_activations
            + sum(gb for _, gb in self.companions)
        )

    def terms(self) -> list[tuple[str, float]]:
        """Every term by name, the companions' after the six of every plan (the vision encoder's where a model has
        one)."""
        fixed = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "companions"]
        return [(k, v) for k, v in fixed if k != "vision_activations" or v] + list(self.companions)

    def as_dict(self) -> dict[str, float]:
        fixed = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "companions"]
        d = {k: round(v, 3) for k, v in fixed + list(self.companions)}
        d["total"] = round(self.total, 3)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> Memory:
        """`as_dict`'s output back (plan.json's gpu_memory_gb)."""
        names = {f.name for f in fields(cls)} - {"companions"}
        companions = tuple((k, v) for k, v in d.items() if k.startswith("companion:"))
        return cls(**{k: v for k, v in d.items() if k in names}, companions=companions)


@dataclass(frozen=True)
class Estimate:
    tokens_per_second: Optional[float]
    step_seconds: Optional[float]
    run_hours: Optional[float]
    usd: Optional[float]


@dataclass(frozen=True)
class Alternative:
    """The job planned on another profile (finetune/planner/advice.py). The contract's first four fields, then:
    the memory usable there, how it would run where that differs from the plan's strategy, the price per
    GPU-hour, and the estimate (the run's hours and cost where its length is known)."""

    hardware: str
    fits: bool
    total_gb: float
    usd_per_month: Optional[float]
    usable_gb: Optional[float] = None
    strategy: Optional[str] = None
    usd_per_gpu_hour: Optional[float] = None
    tokens_per_second: Optional[float] = None
    run_hours: Optional[float] = None
    run_usd: Optional[float] = None


@dataclass(frozen=True)
class Plan:
    fits: bool
    hardware: HardwareConfig
    params_total: int
    params_trainable: int
    # Parameters a token runs through: the total for a dense model, the routed experts' share for a mixture
    # of experts (what users compare MoE models by)
    params_active: int
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
    # The launch's process counts where it sets them (launch.nproc_per_node, launch.nnodes); None: the
    # profile's GPUs per node and nodes (`layout`).
    nproc_per_node: Optional[int] = None
    nnodes: Optional[int] = None

    @property
    def layout(self) -> Layout:
        """The process layout: the profile's GPUs per node and nodes, or the launch's counts where set."""
        hw = self.hardware
        return Layout(
            strategy=self.strategy,
            nproc_per_node=self.nproc_per_node or hw.gpus_per_node,
            nnodes=self.nnodes or hw.nodes,
            device=hw.device,
        )

    def with_processes(self, nproc_per_node: Optional[int], nnodes: Optional[int]) -> Plan:
        """The plan with the launch's process counts (None keeps the profile's)."""
        return replace(self, nproc_per_node=nproc_per_node, nnodes=nnodes)

    def to_dict(self) -> dict[str, Any]:
        """The plan contract of MEMORY_MODEL.md (sizes in decimal GB, per GPU unless named otherwise), then
        the whole hardware profile and the process layout."""
        hw = self.hardware
        profile = {
            f.name: getattr(hw, f.name) for f in fields(HardwareConfig) if f.name not in CONTRACT_HARDWARE
        }
        return {
            "fits": self.fits,
            "hardware": {
                "name": hw.name,
                "gpus": hw.total_gpus,
                "gpu_memory_gb": hw.gpu_memory_gb,
                "host_memory_gb": hw.host_memory_gb,
                "usd_per_month": hw.usd_per_month,
                **{k: list(v) if isinstance(v, list) else v for k, v in profile.items()},
            },
            "params": {
                "total": self.params_total,
                "trainable": self.params_trainable,
                "active": self.params_active,
            },
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
            "layout": self.layout.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """`to_dict`'s output back into a Plan (workers read plan.json; they never re-plan).

        A plan.json written before it carried the whole profile and the layout is refused with one line.
        """
        hw, layout = d.get("hardware") or {}, d.get("layout")
        missing = [f"hardware.{f.name}" for f in fields(HardwareConfig) if f.name not in hw]
        if not isinstance(layout, dict):
            missing.append("layout")
        if "active" not in (d.get("params") or {}):
            missing.append("params.active")
        if missing or not isinstance(layout, dict):
            raise PlanError(
                f"plan.json was written by an older finetune (no {missing[0]}): re-run mode=plan with this run_dir"
            )
        hardware = HardwareConfig(**{f.name: hw[f.name] for f in fields(HardwareConfig)})
        return cls(
            fits=d["fits"],
            hardware=hardware,
            params_total=d["params"]["total"],
            params_trainable=d["params"]["trainable"],
            params_active=d["params"]["active"],
            strategy=Strategy(**d["strategy"]),
            gpu_memory=Memory.from_dict(d["gpu_memory_gb"]),
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
            nproc_per_node=int(layout["processes_per_node"]),
            nnodes=int(layout["nodes"]),
        )
