"""Schema of the `method` config group: full fine-tuning, LoRA or QLoRA, and the settings each takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config.checks import check_choices, check_positive, choice
from finetune.core.errors import ConfigError
from finetune.core.methods import METHODS, MethodSpec

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")


@dataclass
class MethodConfig:
    """Full fine-tuning, LoRA or QLoRA (finetune/core/methods.py says what each is), and the settings each takes."""

    name: str = choice("lora", METHODS)
    # None: the planner chooses (adamw, or an 8-bit optimizer when memory needs it).
    optimizer: Optional[str] = choice(None, OPTIMIZERS)
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    # auto: bf16 on GPUs, fp32 on the CPU (where bf16 matmuls are slow).
    precision: str = choice("auto", ("auto", "bf16", "fp32"))
    # LoRA / QLoRA adapters.
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    # The linear modules to adapt, by PEFT's names; None: every projection of the architecture's decoder
    # layers as finetune/core/architectures.py names them (Llama's seven, Phi's four fused ones): `targets`.
    target_modules: Optional[list[str]] = None
    # A mixture of experts: LoRA on the fused expert weights too (PEFT's target_parameters; no dropout there),
    # besides attention's projections; the router stays frozen.
    lora_experts: bool = False
    # A vision-language model: LoRA on the vision encoder's linear layers too (and the projector trains);
    # false keeps the vision tower frozen and adapts the language model only.
    lora_vision: bool = False
    # fp32 is PEFT's default (upcast adapters); bf16 saves ~30% of activation memory.
    adapter_dtype: str = choice("fp32", ("bf16", "fp32"))
    # QLoRA base quantization (bitsandbytes). compute_dtype: the dtype the 4-bit weights are
    # dequantized to for each matmul; auto follows `precision` (bf16 on GPUs).
    quant_type: str = choice("nf4", ("nf4", "fp4"))
    double_quant: bool = True
    compute_dtype: str = choice("auto", ("auto", "bf16", "fp32"))

    def __post_init__(self) -> None:
        check_choices(self, "method")
        check_positive("method.learning_rate", self.learning_rate)
        check_positive("method.weight_decay", self.weight_decay, allow_zero=True)
        if self.spec.adapters:
            check_positive("method.lora_rank", self.lora_rank)
            check_positive("method.lora_alpha", self.lora_alpha)
            if not 0.0 <= self.lora_dropout < 1.0:
                raise ConfigError(f"method.lora_dropout={self.lora_dropout} must be in [0, 1)")
            if self.lora_experts and self.lora_dropout:
                raise ConfigError(
                    f"method.lora_experts=true needs method.lora_dropout=0 (PEFT's LoRA on parameters has no "
                    f"dropout; it is {self.lora_dropout})"
                )
            if self.target_modules is not None and not self.target_modules:
                raise ConfigError(
                    "method.target_modules is empty: name the projections to adapt (null: all of them)"
                )

    @property
    def spec(self) -> MethodSpec:
        """What this method is (finetune/core/methods.py): every distinction between methods is read from it."""
        return METHODS[self.name]

    def targets(self, architecture: str) -> list[str]:
        """The modules LoRA adapts on a model of `architecture`: `target_modules`, or all its projections."""
        if self.target_modules is not None:
            return list(self.target_modules)
        return list(ARCHITECTURES[architecture].projections)

    @property
    def uses_adapters(self) -> bool:
        return self.spec.adapters

    def dtype_on(self, device: str) -> str:
        """The training precision: `auto` is bf16 on GPUs and fp32 on the CPU; a set value is kept on
        every device (bf16 on a CPU without native bf16 is emulated: slow, but its dtypes flow as on a GPU)."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if device == "cuda" else "fp32"

    def quant_compute_dtype_on(self, device: str) -> str:
        """QLoRA's dequantization dtype: `compute_dtype`, or the training precision when `auto`."""
        return self.dtype_on(device) if self.compute_dtype == "auto" else self.compute_dtype
