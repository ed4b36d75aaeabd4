"""Typed configuration: one dataclass per concern (the schemas; pure, stdlib only).

The YAML files under `configs/` extend these schemas; finetune/core/composition.py
registers them in Hydra's ConfigStore and composes configs/, recipes/ and the
command line once (`OmegaConf.to_object`): everything downstream gets these
objects, never a dict. Cross-field checks live in `__post_init__` and raise
`ConfigError` with the key's name.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config.data import DataConfig
from finetune.core.config.evaluation import EvalConfig
from finetune.core.config.export import ExportConfig
from finetune.core.config.launch import LaunchConfig
from finetune.core.errors import ConfigError
from finetune.core.methods import METHODS, MethodSpec
from finetune.core.parallelism import ENGINES, SHARDED_ENGINES

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
SHARDINGS = tuple(ENGINES)
# train.attention: transformers' attention implementations (finetune/train/throughput.py maps the names).
ATTENTIONS = ("sdpa", "flex", "eager", "flash")
MODES = ("all", "plan", "data", "train", "eval", "export", "launch", "compare")
# Where runs go by default: runs/<name> (mode=compare looks names up here too).
RUNS_DIR = "runs"


def _check_choice(key: str, value: Any, valid: tuple, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, valid))}")


def _check_positive(
    key: str, value: Optional[float], allow_none: bool = False, allow_zero: bool = False
) -> None:
    if value is None:
        if allow_none:
            return
        raise ConfigError(f"{key} must be set")
    _check_finite(key, value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def _check_finite(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")


def _check_all_finite(node: Any, key: str) -> None:
    """NaN and infinity refused in every float of the config (comparisons with NaN are always False,
    so a range check alone lets `method.learning_rate=nan` through to crash the worker after loading)."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            _check_all_finite(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            _check_all_finite(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _check_all_finite(v, f"{key}[{i}]")
    else:
        _check_finite(key, node)


# A run's name names its folder (runs/<name>), the SLURM job and the tmux session: a plain name only.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


@dataclass
class ModelConfig:
    """Architecture facts, so the planner works offline. `config_path` reads a local config.json instead
    (through transformers' AutoConfig: the model class's own defaults fill what the file leaves out)."""

    name: str = "tiny"
    hub_id: Optional[str] = None
    config_path: Optional[str] = None
    architecture: str = (
        "llama"  # llama | mistral | qwen2 | gemma (finetune/core/architectures.py); mixtral is refused
    )
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 172
    vocab_size: int = 512
    tie_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    # Mixture of experts (0: dense): experts per layer, how many run per token, each expert's MLP width.
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # Weights: safetensors only unless this is set (pickle files can run code).
    allow_pickle_weights: bool = False
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        _check_choice("model.architecture", self.architecture, tuple(ARCHITECTURES))
        for key in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            _check_positive(f"model.{key}", getattr(self, key))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(
                f"model.num_experts_per_token={self.num_experts_per_token} must be in 1..{self.num_experts} "
                "(model.num_experts)"
            )


@dataclass
class MethodConfig:
    """Full fine-tuning, LoRA or QLoRA (finetune/core/methods.py says what each is), and the settings each takes."""

    name: str = "lora"
    # None: the planner chooses (adamw, or an 8-bit optimizer when memory needs it).
    optimizer: Optional[str] = None
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    # bf16 | fp32 | auto (bf16 on GPUs, fp32 on the CPU, where bf16 matmuls are slow)
    precision: str = "auto"
    # LoRA / QLoRA adapters.
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # fp32 is PEFT's default (upcast adapters); bf16 saves ~30% of activation memory.
    adapter_dtype: str = "fp32"
    # QLoRA base quantization (bitsandbytes). compute_dtype: the dtype the 4-bit weights are
    # dequantized to for each matmul; auto follows `precision` (bf16 on GPUs).
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("method.name", self.name, tuple(METHODS))
        _check_choice("method.optimizer", self.optimizer, OPTIMIZERS, allow_none=True)
        _check_choice("method.precision", self.precision, ("auto", "bf16", "fp32"))
        _check_choice("method.adapter_dtype", self.adapter_dtype, ("bf16", "fp32"))
        _check_choice("method.quant_type", self.quant_type, ("nf4", "fp4"))
        _check_choice("method.compute_dtype", self.compute_dtype, ("auto", "bf16", "fp32"))
        _check_positive("method.learning_rate", self.learning_rate)
        _check_positive("method.weight_decay", self.weight_decay, allow_zero=True)
        if self.spec.adapters:
            _check_positive("method.lora_rank", self.lora_rank)
            _check_positive("method.lora_alpha", self.lora_alpha)
            if not 0.0 <= self.lora_dropout < 1.0:
                raise ConfigError(f"method.lora_dropout={self.lora_dropout} must be in [0, 1)")
            if not self.target_modules:
                raise ConfigError("method.target_modules is empty: name the projections to adapt")

    @property
    def spec(self) -> MethodSpec:
        """What this method is (finetune/core/methods.py): every distinction between methods is read from it."""
        return METHODS[self.name]

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


@dataclass
class HardwareConfig:
    """One GPU profile (configs/hardware/*.yaml; planner/MEMORY_MODEL.md, "Hardware profiles"). Facts a vendor
    does not publish stay None."""

    name: str = "cpu"
    device: str = "cpu"  # cuda | cpu
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
    usd_per_month: Optional[float] = None
    # hardware=auto: the profiles to choose from, cheapest that fits wins.
    candidates: list[str] = field(default_factory=list)
    # What torch.cuda.get_device_name() reports for this profile's GPU (hardware=local matches on it
    # and on memory); for hardware=local, the names detected.
    gpu_names: list[str] = field(default_factory=list)
    # hardware=local: free disk under the run directory, and what was detected or left unknown (plan reasons).
    disk_free_gb: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_choice("hardware.device", self.device, ("cuda", "cpu"))
        _check_positive("hardware.gpus_per_node", self.gpus_per_node)
        _check_positive("hardware.nodes", self.nodes)
        _check_positive("hardware.gpu_memory_gb", self.gpu_memory_gb, allow_none=True)
        _check_positive("hardware.host_memory_gb", self.host_memory_gb, allow_none=True)

    @property
    def is_auto(self) -> bool:
        return self.name == "auto"

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class TrainConfig:
    """What the trainer does. `None` means: the planner decides; a value a user sets is honoured."""

    # Tokens per sequence; `auto` takes the longest kept sequence from the data stage.
    seq_len: Union[int, str] = 2048
    # Sequences per optimizer step over all GPUs (micro_batch_size x grad_accum_steps x data-parallel ranks).
    batch_size: int = 16
    micro_batch_size: Optional[int] = None
    grad_accum_steps: Optional[int] = None
    activation_checkpointing: Optional[bool] = None
    chunked_loss: Optional[bool] = None
    loss_chunk_size: int = 1024
    sharding: Optional[str] = None  # none | ddp | fsdp | zero3
    # Which engine runs a sharded plan: a key of finetune/core/parallelism.py ENGINES that shards.
    engine: str = "fsdp"
    offload_optimizer: Optional[bool] = None
    offload_params: Optional[bool] = None
    # Length of the run: max_steps when > 0, else epochs over the prepared data.
    max_steps: int = -1
    epochs: float = 1.0
    # Used by the planner's time estimate when no data stage has run yet.
    dataset_tokens: Optional[int] = None
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.03
    max_grad_norm: float = 1.0
    logging_steps: int = 10
    eval_steps: int = 100
    save_steps: int = 200
    save_total_limit: int = 2
    seed: int = 42
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    # Stop early when a loss exceeds this factor times its moving average, or
    # eval loss rises this many evaluations in a row (0 disables each).
    loss_spike_factor: float = 3.0
    eval_rise_patience: int = 3
    # Throughput levers (README "Throughput"); each is exact against the default path on the CPU
    # (tests/test_throughput.py), their GPU speed-ups are measured by scripts/gpu_check.sh.
    # Attention for packed rows: sdpa | flex (FlexAttention block mask, CUDA) | eager | flash
    # (flash-attn's variable-length kernel, CUDA, the flash-attn package).
    attention: str = "sdpa"
    # Liger's Triton kernels (RMSNorm, SwiGLU, RoPE, and its fused linear cross-entropy inside the
    # chunked loss): CUDA and the liger-kernel package (pip install 'finetune[liger]').
    liger: bool = False
    # torch.compile each decoder layer (training only; evaluation and generation run uncompiled).
    compile: bool = False
    # Fused AdamW step (one kernel for all tensors). None: fused on CUDA, unfused on the CPU.
    fused_optimizer: Optional[bool] = None
    # Time each step's phases (data, forward, loss, backward, optimizer) into metrics.json and profile
    # one step's operators (RUN_DIR/profile_ops.txt); synchronizes the GPU at each phase boundary.
    profile: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, str):
            if self.seq_len != "auto":
                raise ConfigError(f"train.seq_len={self.seq_len!r} must be a positive integer or 'auto'")
        else:
            _check_positive("train.seq_len", self.seq_len)
        _check_positive("train.batch_size", self.batch_size)
        _check_positive("train.micro_batch_size", self.micro_batch_size, allow_none=True)
        _check_positive("train.grad_accum_steps", self.grad_accum_steps, allow_none=True)
        _check_positive("train.loss_chunk_size", self.loss_chunk_size)
        _check_positive("train.epochs", self.epochs)
        _check_positive("train.dataset_tokens", self.dataset_tokens, allow_none=True)
        _check_choice("train.sharding", self.sharding, SHARDINGS, allow_none=True)
        if self.engine == "deepspeed":
            raise ConfigError("train.engine=deepspeed is now train.engine=zero3 (DeepSpeed ZeRO-3)")
        _check_choice("train.engine", self.engine, SHARDED_ENGINES)
        _check_choice("train.attention", self.attention, ATTENTIONS)
        if self.compile and self.sharding is not None and ENGINES[self.sharding].shards:
            raise ConfigError(
                f"train.compile=true is proven with train.sharding=none or ddp only, not {self.sharding!r}"
            )
        _check_choice(
            "train.lr_scheduler", self.lr_scheduler, ("cosine", "linear", "constant", "constant_with_warmup")
        )
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        for key in ("logging_steps", "eval_steps", "save_steps", "save_total_limit"):
            _check_positive(f"train.{key}", getattr(self, key))
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"train.max_steps={self.max_steps} must be > 0, or -1 to train by epochs")
        if self.offload_params and self.sharding is not None and not ENGINES[self.sharding].shards:
            raise ConfigError(
                f"train.offload_params=true needs train.sharding={' or '.join(SHARDED_ENGINES)}, not {self.sharding!r}"
            )


@dataclass
class PlanConfig:
    """Pre-flight planner settings."""

    out: Optional[str] = None  # also write plan.json here
    # Fraction of each GPU kept free (allocator fragmentation, spikes) when judging fit.
    headroom: float = 0.10
    # Fraction of the profile's dense bf16 peak reached on the FLOPs a step executes (recomputation
    # included). null: the per-method figure fitted to GPU measurements (finetune/planner/calibration.json).
    mfu: Optional[float] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom < 0.9:
            raise ConfigError(f"plan.headroom={self.headroom} must be in [0, 0.9)")
        if self.mfu is not None and not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"plan.mfu={self.mfu} must be in (0, 1]")


@dataclass
class SmokeConfig:
    """`smoke=true`: the recipe's pipeline on its 8B sibling for a few steps before the real run."""

    enabled: bool = False
    steps: int = 200
    # The sibling recipe; `tiny` stands in where the model hub is unreachable.
    sibling: Optional[str] = None

    def __post_init__(self) -> None:
        _check_positive("smoke.steps", self.steps)


@dataclass
class Config:
    """The root: one object per concern, plus the stage to run and where."""

    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # The recipe's name; names the default run directory.
    name: str = "tiny"
    mode: str = "all"
    run_dir: Optional[str] = None  # default: runs/<name>
    # resume: true (last complete checkpoint), false (start fresh) or a checkpoint path.
    resume: Union[bool, str] = True
    # mode=compare: run directories (or names under runs/) to put side by side.
    runs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_all_finite(self, "")
        _check_choice("mode", self.mode, MODES)
        if not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"name={self.name!r}: use letters, digits and . _ + - (at most 128, no '/' or '..'); "
                "it names the run directory runs/<name>"
            )
        if self.run_dir is not None and (
            not self.run_dir.strip() or re.search(r"[\x00-\x1f\x7f]", self.run_dir)
        ):
            raise ConfigError(
                f"run_dir={self.run_dir!r}: empty or holds control characters (a newline would end a line of "
                "launch.sh or slurm.sbatch)"
            )
        if self.mode == "compare" and len(self.runs) < 1:
            raise ConfigError("mode=compare needs runs=[RUN_DIR,...]: the runs to put side by side")
        if self.method.optimizer == "paged_adamw_8bit" and self.hardware.device == "cpu":
            raise ConfigError(
                "method.optimizer=paged_adamw_8bit needs CUDA (paged memory); use adamw on hardware=cpu"
            )
        if self.hardware.device == "cpu":
            if self.train.attention in ("flex", "flash"):
                why = {
                    "flex": "FlexAttention has no backward on the CPU",
                    "flash": "flash-attn's kernels are CUDA kernels",
                }[self.train.attention]
                raise ConfigError(
                    f"train.attention={self.train.attention} needs CUDA ({why}); use sdpa or eager on hardware=cpu"
                )
            if self.train.liger:
                raise ConfigError(
                    "train.liger=true needs CUDA (Liger's kernels are Triton GPU kernels); leave it off on hardware=cpu"
                )

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir if self.run_dir else Path(RUNS_DIR) / self.name)
