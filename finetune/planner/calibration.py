"""Constants the architecture cannot give, per device kind; read from calibration.json next to this file.

A CPU run is planned with the `cpu` figures (fitted by scripts/bench_planner.py
on this machine's kind), a GPU run with the `cuda` ones (fitted by
scripts/calibrate.py from scripts/gpu_check.py's results and the pipeline's
metrics). calibration.json says, next to each section, which data each figure
was fitted to.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class DeviceCalibration:
    """What one device kind adds to the tensors the memory model counts, and how fast it computes."""

    # CUDA: the context, cuBLAS/NCCL handles (device memory outside PyTorch's allocator). CPU: the process.
    fixed_gb: float
    # The allocator's reserved-but-unused share, as a fraction of what a step allocates and frees
    # (memory.fluctuating: activations, the loss, the working set above it, the gradients).
    allocator_fraction: float
    # Transient gradients of one layer's activations during its backward, as a fraction of what the layer saved.
    backward_working_set_layers: float
    # TRL's fused LM head folds each [4096, 32768] logits tile: a Triton kernel in place on CUDA, torch ops on
    # the CPU, which hold this many fp32 copies of the tile at their peak.
    trl_tile_fp32_copies: float
    # Fraction of the dense bf16 peak reached on the FLOPs a step executes (recomputation included), per method.
    utilisation: dict[str, float] = field(default_factory=dict)
    # TRL's fused LM head, beyond the project's chunked loss: extra seconds per token, as FLOPs of h x V matmuls.
    trl_loss_extra_hv_flops: float = 0.0
    # CPU: freed outputs of each adapted projection that glibc keeps resident in its heap (memory.retained_heap).
    retained_adapter_outputs: float = 0.0
    # CPU: resident GB the training worker's imports add for each optional library that is installed, whether or
    # not the run uses it (DeepSpeed's autotuner imports mlflow, TRL's trainers import wandb): `memory.library_imports`.
    library_imports_gb: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Calibration:
    """Constants the architecture cannot give; see calibration.json."""

    chunked_loss_peak_factor: float
    offload_pcie_gb_per_s: float
    cpu_adam_params_per_s: float
    host_gb_per_rank: float
    default_tokens_per_micro_batch: int
    cpu: DeviceCalibration
    cuda: DeviceCalibration

    def device(self, kind: str) -> DeviceCalibration:
        return self.cuda if kind == "cuda" else self.cpu

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> Calibration:
        """calibration.json's object; keys starting with `_` are notes."""
        top = {k: v for k, v in raw.items() if not k.startswith("_") and k not in ("cpu", "cuda")}

        def device(kind: str) -> DeviceCalibration:
            return DeviceCalibration(**{k: v for k, v in raw[kind].items() if not k.startswith("_")})

        return Calibration(**top, cpu=device("cpu"), cuda=device("cuda"))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("cpu", "cuda")}
        out["cpu"], out["cuda"] = asdict(self.cpu), asdict(self.cuda)
        return out

    def installed(self, kind: str) -> tuple[str, ...]:
        """The optional libraries with an import cost on this device kind that are installed here (found, not
        imported)."""
        return tuple(name for name in self.device(kind).library_imports_gb if importlib.util.find_spec(name))

    @staticmethod
    @lru_cache(maxsize=1)
    def default() -> Calibration:
        return Calibration.from_dict(json.loads(PATH.read_text()))
