"""Which dtype a run trains and evaluates in: `method.precision` (`auto`: bf16 on GPUs, fp32 on the CPU),
bf16 only where the device runs it natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX); elsewhere a
GPU falls back to fp32 and says so, and a CPU keeps emulated bf16 (slow; the tests use it to run a GPU's
dtypes). Evaluation runs in the training compute dtype, QLoRA's in its 4-bit compute dtype.

torch is imported inside the functions: the pipeline's `mode=plan` path loads none of it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.core.config import Config

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (elsewhere they are emulated and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_supported(device: str) -> bool:
    import torch

    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def torch_dtype(name: str) -> torch.dtype:
    """`bf16` / `fp32` as the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def resolve_dtype(name: str, device: str, key: str = "method.precision") -> torch.dtype:
    """The torch dtype for `bf16`/`fp32`.

    bf16 on a CPU without AVX512-BF16 or AMX is kept (emulated, slow): tests use it to run the dtypes a
    GPU runs. A GPU without bf16 (before Ampere) falls back to fp32, with a log line.
    """
    import torch

    dtype = torch_dtype(name)
    if dtype == torch.bfloat16 and not bf16_supported(device):
        if device == "cpu":
            log.warning("%s=bf16 is emulated on this CPU (no AVX512-BF16 or AMX): slow", key)
            return dtype
        log.warning("%s=bf16 is not supported by this GPU: training in fp32", key)
        return torch.float32
    return dtype


def training_dtype(cfg: Config) -> torch.dtype:
    """The compute dtype (bf16 or fp32) the run trains in."""
    return resolve_dtype(cfg.method.dtype_on(cfg.hardware.device), cfg.hardware.device)


def eval_dtype(cfg: Config) -> torch.dtype:
    """Evaluation runs in the training compute dtype (bf16 where native, else fp32)."""
    device = cfg.hardware.device
    quantized = cfg.method.spec.quantized_base
    name = cfg.method.quant_compute_dtype_on(device) if quantized else cfg.method.dtype_on(device)
    key = "method.compute_dtype" if quantized else "method.precision"
    return resolve_dtype(name, cfg.hardware.device, key=key)
