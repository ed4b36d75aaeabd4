"""Schema of the `train` config group: what the trainer does (`None`: the planner decides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from finetune.core.config.checks import check_choices, check_positive, choice
from finetune.core.errors import ConfigError

SHARDINGS = ("none", "ddp", "fsdp", "zero3")
# train.attention: transformers' attention implementations (finetune/train/throughput.py maps the names).
ATTENTIONS = ("sdpa", "flex", "eager", "flash")


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
    sharding: Optional[str] = choice(None, SHARDINGS)
    # Which engine runs a sharded plan.
    engine: str = choice("fsdp", ("fsdp", "deepspeed"))
    offload_optimizer: Optional[bool] = None
    offload_params: Optional[bool] = None
    # Length of the run: max_steps when > 0, else epochs over the prepared data.
    max_steps: int = -1
    epochs: float = 1.0
    # Used by the planner's time estimate when no data stage has run yet.
    dataset_tokens: Optional[int] = None
    lr_scheduler: str = choice("cosine", ("cosine", "linear", "constant", "constant_with_warmup"))
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
    # Attention for packed rows: flex is FlexAttention's block mask (CUDA), flash is flash-attn's
    # variable-length kernel (CUDA, the flash-attn package).
    attention: str = choice("sdpa", ATTENTIONS)
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
            check_positive("train.seq_len", self.seq_len)
        check_positive("train.batch_size", self.batch_size)
        check_positive("train.micro_batch_size", self.micro_batch_size, allow_none=True)
        check_positive("train.grad_accum_steps", self.grad_accum_steps, allow_none=True)
        check_positive("train.loss_chunk_size", self.loss_chunk_size)
        check_positive("train.epochs", self.epochs)
        check_positive("train.dataset_tokens", self.dataset_tokens, allow_none=True)
        check_choices(self, "train")
        if self.compile and self.sharding in ("fsdp", "zero3"):
            raise ConfigError(
                f"train.compile=true is proven with train.sharding=none or ddp only, not {self.sharding!r}"
            )
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        for key in ("logging_steps", "eval_steps", "save_steps", "save_total_limit"):
            check_positive(f"train.{key}", getattr(self, key))
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"train.max_steps={self.max_steps} must be > 0, or -1 to train by epochs")
        if self.offload_params and self.sharding in ("none", "ddp"):
            raise ConfigError(
                f"train.offload_params=true needs train.sharding=fsdp or zero3, not {self.sharding!r}"
            )
