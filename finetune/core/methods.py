"""What distinguishes one training method from another: one description per method (pure: stdlib only).

Every consumer reads the method's facts from here instead of comparing its
name: the config's validation (`method.name`, and whether the LoRA keys
apply), the loader (finetune/modeling/models.py: the base's dtype or its 4-bit
quantization, PEFT's adapters), the planner (which weights train, the frozen
base's bytes, whether FSDP2 / ZeRO-3 may shard it, FLOPs a token, what to
suggest when it does not fit) and the export (what merging means, how vLLM
serves it). The settings a user tunes (rank, learning rate, quantization type)
are `MethodConfig`'s, with each method's defaults in configs/method/NAME.yaml.

Adding a method (DoRA, say) is one `MethodSpec` in `METHODS`, its
configs/method/NAME.yaml, and its tests. The planner's activation formulas and
utilisation were measured per method: a new adapter method is planned with
LoRA's formulas (`finetune.planner.activations`) and has no time estimate until
calibration.json's `cuda.utilisation` has its figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# What exporting the trained model means (finetune/export/merge.py).
MERGES = (
    "cast",  # nothing to merge: the trained weights are the model, cast to the merge dtype
    "adapter",  # merge_and_unload() folds the adapters into the original 16-bit base
    # the same, on a base of export.qlora_merge_base (the original, or the 4-bit one dequantized), or into the
    # 4-bit base itself under export.allow_lossy_4bit_merge
    "adapter_quantized_base",
)


@dataclass(frozen=True)
class MethodSpec:
    """One method's facts. `MethodConfig.spec` is the entry for `method.name`."""

    name: str
    description: str  # one line, for people
    # Every weight trains (gradients, fp32 master copy, moments); the LM head is trainable. Otherwise the
    # base is frozen and only the adapters train.
    trains_base_weights: bool
    # PEFT LoRA adapters on the frozen base (method.lora_* and target_modules apply; the trained output is an
    # adapter, RUN_DIR/adapter, served by vLLM as base + adapter besides the merged model).
    adapters: bool
    # The frozen base is stored in 4 bits (bitsandbytes, `method.quant_type`) and dequantized to
    # `method.compute_dtype` for each matmul; otherwise it is stored in the compute dtype.
    quantized_base: bool
    # FLOPs a weight costs a token: 2 forward, 2 the input gradient, 2 more when the weight itself trains.
    flops_per_weight: float
    merge: str  # one of MERGES
    # vLLM serves the trained adapter on the base (`--enable-lora`, serve.sh's `lora` variant) besides the merged
    # model. vLLM's LoRA loads plain LoRA adapters only: a DoRA entry would set False and be served merged
    # (vllm-project/vllm#10849, DoRA support, is open).
    serve_adapter: bool
    # Why FSDP2 / ZeRO-3 cannot shard it (one line), or None when they can.
    shard_refusal: Optional[str] = None
    # When a plan does not fit: the lighter method the planner tries on the same hardware, and the settings it
    # changes for the try (method.KEY, value).
    fallback: Optional[str] = None
    fallback_settings: tuple[tuple[str, Any], ...] = ()
    # Extra keyword arguments of PEFT's LoraConfig (DoRA would be (("use_dora", True),)).
    lora_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.merge not in MERGES:
            raise ValueError(
                f"MethodSpec {self.name}: merge={self.merge!r} is not one of {', '.join(MERGES)}"
            )
        if (self.merge == "cast") == self.adapters:
            raise ValueError(
                f"MethodSpec {self.name}: merge={self.merge!r} contradicts adapters={self.adapters}"
            )
        if self.serve_adapter and not self.adapters:
            raise ValueError(f"MethodSpec {self.name}: serve_adapter needs adapters")
        if self.trains_base_weights == self.adapters:
            raise ValueError(f"MethodSpec {self.name}: exactly one of the base weights or adapters trains")

    @property
    def can_shard(self) -> bool:
        """FSDP2 and ZeRO-3 run it (finetune/planner/engines.py)."""
        return self.shard_refusal is None


METHODS: dict[str, MethodSpec] = {
    "full": MethodSpec(
        "full",
        "full fine-tuning: every weight trains (bf16 mixed precision, fp32 master weights and Adam moments)",
        trains_base_weights=True,
        adapters=False,
        quantized_base=False,
        flops_per_weight=6.0,
        merge="cast",
        serve_adapter=False,
        fallback="lora",
        fallback_settings=(("optimizer", None),),  # the planner picks LoRA's optimizer afresh
    ),
    "lora": MethodSpec(
        "lora",
        "LoRA: low-rank adapters on the projections of a frozen base held in the compute dtype",
        trains_base_weights=False,
        adapters=True,
        quantized_base=False,
        flops_per_weight=4.0,
        merge="adapter",
        serve_adapter=True,
        fallback="qlora",
        fallback_settings=(("adapter_dtype", "bf16"),),  # QLoRA's own default (configs/method/qlora.yaml)
    ),
    # Shards under FSDP2 and ZeRO-3: packed in the training dtype, its 4-bit weights are divided like any frozen
    # weight and gathered with their quantization state (finetune/modeling/models.py, tests/test_qlora_sharded.py).
    "qlora": MethodSpec(
        "qlora",
        "QLoRA: LoRA adapters on a frozen base quantized to 4 bits (bitsandbytes NF4)",
        trains_base_weights=False,
        adapters=True,
        quantized_base=True,
        flops_per_weight=4.0,
        merge="adapter_quantized_base",
        serve_adapter=True,
    ),
}
