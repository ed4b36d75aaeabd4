"""Schema of the `train` config group: what the trainer does (`None`: the planner decides).

`TrainConfig` combines one small dataclass per concern (batch shape, strategy, schedule,
intervals, early stop, speed, profiling). The keys stay flat on the command line
(`train.seq_len`, `train.sharding`): the concerns are how the schema reads, not extra levels.
Each concern checks its own fields; checks across concerns live in `TrainConfig.__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from finetune.core.config.checks import DATA_KEY, check_choices, check_positive, choice
from finetune.core.errors import ConfigError
from finetune.core.parallelism import ENGINES, SEQUENCE_SPLITS, SHARDED_ENGINES

SHARDINGS = tuple(ENGINES)
# train.report_to: the trackers whose runs are tested (docs/tracking.md), as transformers' report_to names them.
TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")
# train.attention: transformers' attention implementations (finetune/train/throughput.py maps the names).
ATTENTIONS = ("sdpa", "flex", "eager", "flash")


@dataclass
class TrainBatch:
    """Batch shape: the tokens of one optimizer step and how they are split."""

    seq_len: Union[int, str] = field(default=2048, metadata=DATA_KEY)
    """Tokens per sequence; `auto` takes the longest kept sequence from the data stage."""
    batch_size: int = 16
    """Sequences per optimizer step, all GPUs: micro_batch_size x grad_accum_steps x data-parallel ranks."""
    micro_batch_size: Optional[int] = None
    """Sequences per GPU in one forward and backward pass; None: the planner chooses."""
    grad_accum_steps: Optional[int] = None
    """Micro-batches accumulated per optimizer step; None: the planner derives it from batch_size."""

    def _check_batch(self) -> None:
        if isinstance(self.seq_len, str):
            if self.seq_len != "auto":
                raise ConfigError(f"train.seq_len={self.seq_len!r} must be a positive integer or 'auto'")
        else:
            check_positive("train.seq_len", self.seq_len)
        check_positive("train.batch_size", self.batch_size)
        check_positive("train.micro_batch_size", self.micro_batch_size, allow_none=True)
        check_positive("train.grad_accum_steps", self.grad_accum_steps, allow_none=True)


@dataclass
class TrainStrategy:
    """How the job fits in memory: the planner's choices (None: the planner decides), honoured when set."""

    activation_checkpointing: Optional[bool] = None
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
    chunked_loss: Optional[bool] = None
    """The project's chunked cross-entropy (true) or TRL's fused LM head (false); None: the planner's."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the chunked loss (the logits held at once)."""
    sharding: Optional[str] = choice(None, SHARDINGS)
    """A full copy on each GPU (none, ddp) or the states sharded across the GPUs (fsdp, zero3)."""
    engine: Optional[str] = choice(None, SHARDED_ENGINES)
    """Which engine runs a sharded plan (a key of finetune/core/parallelism.py's ENGINES that shards); None: the
    planner weighs every sharded engine and takes the fastest plan that fits."""
    offload_optimizer: Optional[bool] = None
    """Keep the optimizer states in host memory."""
    offload_params: Optional[bool] = None
    """Keep the sharded weights in host memory (fsdp or zero3 only)."""
    sequence_parallel: Optional[int] = None
    """Ranks each sequence is split over (divides the GPUs, and the heads under Ulysses); 1: no split; None:
    the planner splits when a sequence's activations do not fit otherwise."""
    sequence_split: Optional[str] = choice(None, tuple(SEQUENCE_SPLITS))
    """How a sequence is split (a key of finetune/core/parallelism.py's SEQUENCE_SPLITS): ulysses (DeepSpeed,
    zero3) or ring (torch context parallelism, fsdp); None: the planner weighs both."""
    activation_offloading: Optional[bool] = None
    """Move the checkpointed layer inputs to host memory (TRL's activation_offloading); None: the planner's."""

    def _check_strategy(self) -> None:
        if self.engine == "deepspeed":
            raise ConfigError("train.engine=deepspeed is now train.engine=zero3 (DeepSpeed ZeRO-3)")
        check_choices(self, "train", TrainStrategy)
        check_positive("train.loss_chunk_size", self.loss_chunk_size)
        check_positive("train.sequence_parallel", self.sequence_parallel, allow_none=True)


@dataclass
class TrainSchedule:
    """How long the run trains, and the learning-rate schedule, clipping and seed along the way."""

    max_steps: int = -1
    """Optimizer steps to train when > 0; -1: train.epochs over the prepared data."""
    epochs: float = 1.0
    """Passes over the prepared data (when train.max_steps is -1)."""
    dataset_tokens: Optional[int] = None
    """Tokens in the data, for the planner's time estimate before a data stage has run."""
    lr_scheduler: str = choice("cosine", ("cosine", "linear", "constant", "constant_with_warmup"))
    """The learning rate's shape over the run (transformers' schedulers)."""
    warmup_ratio: float = 0.03
    """Fraction of the steps over which the learning rate ramps up from 0."""
    max_grad_norm: float = 1.0
    """Gradients clipped to this global norm."""
    seed: int = 42
    """Seeds the run: the adapters' initialisation, dropout and the data order."""

    def length(self) -> dict[str, Any]:
        """How long a run is asked to train (metrics.json records it: a run is finished for this length only)."""
        return {"max_steps": self.max_steps, "epochs": self.epochs}

    def _check_schedule(self) -> None:
        check_choices(self, "train", TrainSchedule)
        check_positive("train.epochs", self.epochs)
        check_positive("train.dataset_tokens", self.dataset_tokens, allow_none=True)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"train.max_steps={self.max_steps} must be > 0, or -1 to train by epochs")


@dataclass
class TrainIntervals:
    """How often the trainer logs, evaluates and saves, and where the logs go."""

    logging_steps: int = 10
    """Steps between logged losses."""
    eval_steps: int = 100
    """Steps between held-out loss evaluations."""
    save_steps: int = 200
    """Steps between checkpoints."""
    save_total_limit: int = 2
    """Complete checkpoints kept (the newest)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where the logs go (TRACKERS): tensorboard (RUN_DIR/tensorboard), mlflow (MLFLOW_TRACKING_URI), wandb
    (WANDB_MODE=offline works without network), trackio; [] for none (docs/tracking.md)."""

    def _check_intervals(self) -> None:
        for key in ("logging_steps", "eval_steps", "save_steps", "save_total_limit"):
            check_positive(f"train.{key}", getattr(self, key))
        unknown = [name for name in self.report_to if name not in TRACKERS]
        if unknown:
            raise ConfigError(
                f"train.report_to: unknown tracker {unknown[0]!r} (choose from {', '.join(TRACKERS)}, or [] for none)"
            )


@dataclass
class TrainEarlyStop:
    """Stop early (after saving) when training goes wrong; 0 disables each test."""

    loss_spike_factor: float = 3.0
    """Stop when a loss exceeds this factor times its moving average."""
    eval_rise_patience: int = 3
    """Stop when the eval loss rises this many evaluations in a row."""


@dataclass
class TrainSpeed:
    """Throughput switches (README "Throughput"): each is exact against the default path on the CPU
    (tests/test_throughput.py); their GPU speed-ups are measured by scripts/gpu_check.sh."""

    attention: Optional[str] = choice(None, ATTENTIONS)
    """Attention for packed rows; flex (FlexAttention's block mask) and flash (flash-attn) need CUDA; None: the
    planner's (SDPA; FlexAttention for long packed rows on one GPU: finetune/planner/attention.py)."""
    liger: bool = False
    """Liger's Triton kernels, its fused linear cross-entropy in the chunked loss (CUDA, finetune[liger])."""
    compile: bool = False
    """torch.compile each decoder layer (training only; evaluation and generation run uncompiled)."""
    fused_optimizer: Optional[bool] = None
    """Fused AdamW step (one kernel for all tensors); None: fused on CUDA, unfused on the CPU."""

    def _check_speed(self) -> None:
        check_choices(self, "train", TrainSpeed)


@dataclass
class TrainProfiling:
    """Where a step's time goes (slower: the GPU is synchronized at each phase boundary)."""

    profile: bool = False
    """Time each step's phases (metrics.json) and one step's operators (RUN_DIR/profile_ops.txt)."""


# The concerns in reverse: a dataclass takes its bases' fields from the last base to the first, so the
# flat keys (and config.yaml) read batch shape first and profiling last.
@dataclass
class TrainConfig(
    TrainProfiling, TrainSpeed, TrainEarlyStop, TrainIntervals, TrainSchedule, TrainStrategy, TrainBatch
):
    """What the trainer does. `None` means: the planner decides; a value a user sets is honoured."""

    def __post_init__(self) -> None:
        self._check_batch()
        self._check_strategy()
        self._check_schedule()
        self._check_intervals()
        self._check_speed()
        if self.compile and self.sharding is not None and ENGINES[self.sharding].shards:
            raise ConfigError(
                f"train.compile=true is proven with train.sharding=none or ddp only, not {self.sharding!r}"
            )
        if self.offload_params and self.sharding is not None and not ENGINES[self.sharding].shards:
            raise ConfigError(
                f"train.offload_params=true needs train.sharding={' or '.join(SHARDED_ENGINES)}, not {self.sharding!r}"
            )
