"""What ran of a 4-bit base (QLoRA): each rank's share of the packed weights, and a digest of them dequantized.

FSDP2 and ZeRO-3 divide the packed 4-bit weights (stored in the training dtype where they shard,
finetune/modeling/models.py) like any other frozen weight. Their quantization constants (the blocks'
absmax, the double-quantization state) are attributes of bitsandbytes' `QuantState`, not parameters: every
rank keeps them whole. `record` counts both on each rank, and digests the weights as the engine hands them
to a forward (ZeRO-3 gathers the parameter, which keeps its `quant_state`; FSDP2 all-gathers a plain
parameter, and bitsandbytes' Linear4bit rebuilds its Params4bit from the module's `quant_state`), then
dequantized by bitsandbytes. One process's digest equals a sharded run's only if the quantization state
survived the gather (tests/test_qlora_sharded.py).

The digest covers the 4-bit layers in model order up to `DIGEST_WEIGHTS` weights (the whole of a small
model, the first projection or so of a 70B), so its cost stays bounded; every rank takes part in the gathers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

# Dequantized weights digested at most: 128 MB in bf16.
DIGEST_WEIGHTS = 64 * 2**20


def _linear4bit_modules(model: Any) -> list[tuple[str, Any]]:
    import bitsandbytes as bnb

    return [(name, m) for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


def _quant_state(module: Any) -> Any:
    """The layer's QuantState: on its Params4bit, or on the module where FSDP2 replaced the parameter."""
    return getattr(module.weight, "quant_state", None) or module.quant_state


def _constants_bytes(state: Any) -> int:
    """Bytes of a QuantState's tensors (absmax and code, and the nested state's when double-quantized)."""
    tensors = [state.absmax, state.code, state.offset]
    if state.state2 is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _storage_bytes(weight: Any) -> tuple[int, int]:
    """(held by this rank, whole) bytes of a packed 4-bit weight: a ZeRO-3 partition, an FSDP2 shard, or all."""
    size = weight.element_size()
    if hasattr(weight, "ds_tensor"):  # ZeRO-3: this rank's partition (padded to the world size)
        return weight.ds_tensor.numel() * size, weight.ds_numel * size
    if hasattr(weight, "to_local"):  # FSDP2: a DTensor, this rank's shard is the local tensor
        return weight.to_local().numel() * size, weight.numel() * size
    return weight.numel() * size, weight.numel() * size


@contextmanager
def _gathered(trainer: Any, name: str, module: Any, units: dict[str, Any]) -> Iterator[None]:
    """The layer's whole weight on this rank, gathered as the engine gathers it for a forward."""
    weight = module.weight
    if hasattr(weight, "ds_id"):  # ZeRO-3: the parameter object itself, refilled (its quant_state stays)
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            yield
        return
    owner = next((units[p] for p in sorted(units, key=len, reverse=True) if name.startswith(p)), None)
    if owner is None:  # one process, DDP: whole already
        yield
        return
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    owner.unshard()  # FSDP2: a plain nn.Parameter without the quantization state is set on the module
    try:
        # What Linear4bit.forward does first: a Params4bit again, its quant_state from the module.
        fix_4bit_weight_quant_state_from_module(module)
        yield
    finally:
        owner.reshard()


def _fsdp_units(model: Any) -> dict[str, Any]:
    """FSDP2's units by module name ('' is the root), each the nearest owner of the modules under it."""
    from torch.distributed.fsdp import FSDPModule

    return {(f"{name}." if name else ""): m for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def record(trainer: Any) -> Optional[dict[str, Any]]:
    """This rank's share of the 4-bit base and the digest of its dequantized weights; None without one.

    Every rank must call it (the gathers are collectives); each returns its own byte counts and the same
    digest.
    """
    import bitsandbytes.functional as bnbf

    model = trainer.model
    layers = _linear4bit_modules(model)
    if not layers:
        return None
    units = _fsdp_units(model) if trainer.is_fsdp_enabled else {}
    held = whole = constants = 0
    digest, digested, weights = hashlib.sha256(), 0, 0
    storage = {str(m.weight.dtype).removeprefix("torch.") for _, m in layers}
    for name, module in layers:
        mine, full = _storage_bytes(module.weight)
        held, whole = held + mine, whole + full
        constants += _constants_bytes(_quant_state(module))
        if weights >= DIGEST_WEIGHTS:
            continue
        with _gathered(trainer, name, module, units):
            weight = module.weight
            dequantized = bnbf.dequantize_4bit(weight.data, weight.quant_state)
            digest.update(dequantized.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digested += 1
        weights += dequantized.numel()
    return {
        "layers": len(layers),
        "storage_dtype": sorted(storage),
        "storage_bytes_held": held,
        "storage_bytes": whole,
        # whole on every rank: QuantState's tensors are not parameters, no engine divides them
        "constants_bytes": constants,
        "dequantized_sha256": digest.hexdigest(),
        "digested_layers": digested,
        "digested_weights": weights,
    }
