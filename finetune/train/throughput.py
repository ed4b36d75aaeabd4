"""Throughput levers, each a `train.*` switch: attention for packed rows, Liger's kernels, torch.compile of
the decoder layers, the fused optimizer step (`method.adapter_dtype=bf16` is the fifth, in finetune/modeling/models.py).

Each is exact against the default path on the CPU (tests/test_throughput.py); which is fastest on a GPU
is measured by scripts/gpu_check.sh (its pipeline cases time every step's phases: `train.profile`).
Defaults stay the measured baseline until GPU measurements say otherwise.

Attention for packed rows (several samples in one row, position ids restarting at each sample, no
attention mask: `PackedCollator`). transformers (ARCHITECTURE.md, "Checked against") finds the samples
from the position ids (`masking_utils.find_packed_sequence_indices`) and, per implementation:

- `sdpa`: a [batch, 1, seq, seq] block-diagonal boolean mask. On CUDA any mask rules SDPA's flash
  kernel out: it runs the memory-efficient kernel over the whole seq x seq square, masked parts
  included. A row holding one sequence gets no mask (`is_causal=True`) and keeps the flash kernel.
- `flex`: a FlexAttention `BlockMask` built from the same mask function; 128 x 128 blocks outside
  every sample are skipped, so the work follows the samples' lengths, on a fused kernel. Training
  needs CUDA (the torch of ARCHITECTURE.md's "Checked against" has no FlexAttention backward on the CPU).
- `flash`: flash-attn's variable-length kernel, sample boundaries taken from the position ids;
  transformers does that only for a batch of one row (`_is_packed_sequence`), so with `flash` the
  collator flattens each micro-batch into one row (`PackedCollator(flatten=True)`). CUDA and the
  flash-attn package.
- `eager`: an additive mask and materialised scores: the reference.

So `flex` and `flash` keep a fused kernel on packed rows; `sdpa` keeps it only for unpacked rows.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Optional

from finetune.core.config import Config
from finetune.core.errors import ConfigError
from finetune.core.parallelism import ENGINES

log = logging.getLogger(__name__)

# Liger's layer kernels, applied by the Trainer (`use_liger_kernel`, transformers' `apply_liger_kernel`)
# when training starts. Its fused linear cross-entropy is not patched into the model: TRL refuses
# that (its own fused LM head replaces the forward), and the chunked loss runs Liger's kernel itself
# when `train.liger` is on (`chunked_loss.linear_cross_entropy`).
LIGER_KERNELS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def sft_kwargs(cfg: Config) -> dict[str, Any]:
    """The SFTConfig arguments of the levers the Trainer applies (Liger's kernels through TRL's switch).

    TRL (ARCHITECTURE.md, "Checked against") deprecates `use_liger_kernel` for Hub kernels
    (`model_init_kwargs={"use_kernels": True}`), which are downloaded when the model loads: not possible
    without the model hub, so the installed liger-kernel package is what `train.liger` uses.
    """
    if not cfg.train.liger:
        return {}
    return {"use_liger_kernel": True, "liger_kernel_config": dict(LIGER_KERNELS)}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_runtime(cfg: Config, sharding: Optional[str] = None) -> None:
    """Refuse, in one line (ConfigError, exit 2), a lever this machine or this plan cannot run.

    The config refuses what needs CUDA on hardware=cpu already; this checks the machine the worker
    runs on (CUDA present, packages installed) and the planned sharding.
    """
    t = cfg.train
    if t.liger:
        if not _installed("liger_kernel"):
            raise ConfigError(
                "train.liger=true needs the liger-kernel package (pip install 'finetune[liger]'); not installed here"
            )
        if not _cuda():
            raise ConfigError(
                "train.liger=true needs a CUDA GPU (Liger's kernels are Triton GPU kernels); none here"
            )
    if t.attention == "flash":
        if not _installed("flash_attn"):
            raise ConfigError(
                "train.attention=flash needs the flash-attn package (pip install flash-attn); not installed here"
            )
        if not _cuda():
            raise ConfigError("train.attention=flash needs a CUDA GPU; none here")
    if t.attention == "flex" and not _cuda():
        raise ConfigError(
            "train.attention=flex needs a CUDA GPU (FlexAttention has no backward on the CPU); none here"
        )
    if t.compile and sharding is not None and ENGINES[sharding].shards:
        raise ConfigError(
            f"train.compile=true is proven with sharding none or ddp only; the plan shards with {sharding}"
        )


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a transformers causal LM (a PEFT model's base model's), in order."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"train.compile=true: no decoder layers found in {type(base).__name__}")
    return list(layers)


def compile_decoder_layers(model: Any) -> int:
    """torch.compile each decoder layer's forward, used in training mode only; returns the layers compiled.

    Per layer rather than the whole model (SFTConfig's `torch_compile`): the layers share one compiled
    graph (torch >= 2.5 inlines nn modules, so the parameters are graph inputs), the loss head and its
    Python loop stay out of the graph, and compile time does not grow with depth. The layer's forward
    is transformers' checkpointing wrapper, so activation checkpointing is traced into the graph.
    Evaluation and generation (a KV cache, one token at a time) run the layers uncompiled.
    """
    import torch

    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_finetune_compiled", False):
            continue
        eager = layer.forward
        compiled = torch.compile(eager)

        def forward(
            *args: Any, _eager: Any = eager, _compiled: Any = compiled, _layer: Any = layer, **kwargs: Any
        ):
            return _compiled(*args, **kwargs) if _layer.training else _eager(*args, **kwargs)

        layer.forward = forward
        layer._finetune_compiled = True
    log.info("train.compile: %d decoder layers compiled (training mode only)", len(layers))
    return len(layers)


def record(trainer: Any) -> dict[str, Any]:
    """The levers that really ran, for metrics.json's `train.engine` (read after training)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    try:
        compiled = any(getattr(layer, "_finetune_compiled", False) for layer in decoder_layers(model))
    except ConfigError:
        compiled = False
    return {
        "attention": getattr(base.config, "_attn_implementation", None),
        "compiled_layers": compiled,
        "liger": bool(trainer.args.use_liger_kernel),
        "activation_offloading": bool(getattr(trainer.args, "activation_offloading", False)),
        "sequence_split": sequence_split_record(trainer, base),
    }


def sequence_split_record(trainer: Any, base: Any) -> Optional[dict[str, Any]]:
    """The sequence split as accelerate ran it (its ParallelismConfig), or None: the size and backend, the
    attention kernel the split wraps, this rank's place in the split and its contiguous share of each
    sequence (accelerate's UlyssesSPDataLoaderAdapter and torch's context_parallel both cut equal shares)."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is None:
        return None
    if (pc.sp_size or 1) > 1:
        size, backend, field = pc.sp_size, pc.sp_backend, "sp_size"
    elif (pc.cp_size or 1) > 1:
        size, backend, field = pc.cp_size, pc.cp_backend, "cp_size"
    else:
        return None
    rank = trainer.accelerator.process_index % size
    return {
        field: size,
        "backend": backend,
        "attention": getattr(base.config, "_attn_implementation", None),
        "rank_in_split": rank,
        "share_of_each_sequence": f"tokens [{rank}/{size}, {rank + 1}/{size}) of each sequence",
    }
