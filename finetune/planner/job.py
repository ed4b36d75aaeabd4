"""What the memory terms are computed from: the job (model, method, hardware, training settings, sequence
length, objective) and what runs for it (`Runtime`: the engine and the dtypes, derived by `runtime()` as
finetune/train sets the run up). finetune/planner/memory.py says what runs per engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from finetune.core.config import HardwareConfig, MethodConfig, ModelConfig, PlanConfig, TrainConfig
from finetune.core.objectives import OBJECTIVES, ObjectiveSpec
from finetune.core.parallelism import Engine
from finetune.planner.attention import takes_mask
from finetune.planner.calibration import Calibration, DeviceCalibration
from finetune.planner.companions import CompanionShape
from finetune.planner.contract import GB, Strategy
from finetune.planner.params import ParamCounts, count_params, lora_params

# TRL's fused LM head (trl/kernels/chunked_logprob.py): tiles of this many tokens x vocabulary entries.
TRL_TILE_TOKENS = 4096


TRL_TILE_VOCAB = 32768


# Bytes of a memory page on the CPU (x86-64 and most arm64 Linux kernels): what the resident set grows by.
CPU_PAGE_BYTES = 4096


# ZeRO-3's optimizer sub-group (our DeepSpeed JSON's sub_group_size): one fp32 gradient buffer of this size.
ZERO3_SUB_GROUP = 1_000_000_000


def quant_constant_bits(double_quant: bool) -> float:
    """bitsandbytes' NF4 quantization constants per weight: an fp32 absmax per block of 64 (0.5 bits), or with
    double quantization an 8-bit absmax per block plus an fp32 one per 256 blocks (0.127 bits)."""
    return 8 / 64 + 32 / (64 * 256) if double_quant else 32 / 64


@dataclass(frozen=True)
class Job:
    """Everything the plan depends on, resolved: the model, method, hardware, training settings, sequence
    length, the exact counts, the calibration, and the planning settings (headroom, utilisation)."""

    model: ModelConfig
    method: MethodConfig
    hw: HardwareConfig
    train: TrainConfig
    seq_len: int
    counts: ParamCounts
    adapter: int  # LoRA parameters (0 for full fine-tuning)
    cal: Calibration
    plan: PlanConfig = field(default_factory=PlanConfig)
    # What the model is trained to do (finetune/core/objectives.py): sequences per example, the reference model.
    objective: ObjectiveSpec = OBJECTIVES["sft"]
    # Full fine-tuning's reference: precomputed log-probabilities (True), a frozen copy (False), or the
    # planner's choice on memory and time (None; `objective.reference=auto`).
    precompute_reference: Optional[bool] = None
    # A `when_kl` reference runs (the settings' KL coefficient is above 0: GRPO's and RLOO's beta), its
    # log-probabilities taken in the rollout, before the training forward.
    kl_reference: bool = False
    # data.packing: rows packed from several samples (a sequence split must keep them apart)
    packing: bool = True
    # The frozen models beside the policy (a teacher, a reward model), resolved to their shapes.
    companions: tuple[CompanionShape, ...] = ()
    # The optional libraries installed where the job runs that the training worker imports whether it uses them or
    # not (a key of the device's `library_imports_gb`; `Calibration.installed`).
    installed: tuple[str, ...] = ()

    @property
    def sequences(self) -> int:
        """Sequences one example puts through the model (DPO: its chosen and its rejected answer)."""
        return self.objective.sequences_per_example

    @property
    def reference_runs(self) -> bool:
        """A frozen reference model runs a forward every step (DPO), unless its log-probabilities are precomputed."""
        return self.objective.reference == "always"

    @property
    def library_imports(self) -> float:
        """Bytes the worker's imports of the installed optional libraries hold on this device (the CPU's resident
        set: DeepSpeed's autotuner imports mlflow, TRL's trainers wandb; nothing on a GPU)."""
        return sum(self.device.library_imports_gb.get(name, 0.0) for name in self.installed) * GB

    @property
    def trainable(self) -> int:
        return self.counts.total if self.method.spec.trains_base_weights else self.adapter

    @property
    def device(self) -> DeviceCalibration:
        return self.cal.device(self.hw.device)

    def but(self, **changes: Any) -> Job:
        """The same job with some of its settings changed (model, method, hw, train, seq_len); the counts
        are derived again."""
        settings: dict[str, Any] = dict(
            model=self.model, method=self.method, hw=self.hw, train=self.train, seq_len=self.seq_len
        )
        settings.update(changes)
        job = make_job(
            **settings, cal=self.cal, plan=self.plan, objective=self.objective, packing=self.packing
        )
        return replace(
            job,
            precompute_reference=self.precompute_reference,
            kl_reference=self.kl_reference,
            companions=self.companions,
            installed=self.installed,
        )


def make_job(
    model: ModelConfig,
    method: MethodConfig,
    hw: HardwareConfig,
    train: TrainConfig,
    seq_len: int,
    cal: Optional[Calibration] = None,
    plan: Optional[PlanConfig] = None,
    objective: Optional[ObjectiveSpec] = None,
    packing: bool = True,
) -> Job:
    objective = objective or OBJECTIVES["sft"]
    counts = count_params(model)
    adapter = lora_params(model, method) if method.uses_adapters else 0
    if objective.head == "score":
        # a sequence classifier: a score head of h x 1 weights in place of the LM head (the embedding keeps its
        # own when the two were tied); with adapters it trains in full (PEFT's trainable copy of it)
        counts = replace(counts, lm_head=score_head_params(model))
        adapter += score_head_params(model) if method.uses_adapters else 0
    return Job(
        model, method, hw, train, seq_len, counts, adapter, cal or Calibration.default(),
        plan or PlanConfig(), objective, packing=packing,
    )  # fmt: skip


def score_head_params(model: ModelConfig) -> int:
    """A one-label sequence-classification head: one weight per hidden unit, no bias (transformers' `score`)."""
    return model.hidden_size


def micro_batch_rows(job: Job, s: Strategy) -> int:
    """Sequences in one micro-batch: `micro_batch_size` examples, each putting `job.sequences` through the model
    (TRL's preference collator concatenates the chosen and the rejected rows into one batch)."""
    return s.micro_batch_size * job.sequences


@dataclass(frozen=True)
class Runtime:
    """What runs: the engine and the dtypes (bytes per value) of each kind of tensor."""

    engine: Engine  # the plan's (finetune/core/parallelism.py)
    device: str  # cpu | cuda: dropout masks and TRL's tile folding differ
    compute: int  # 2 bf16, 4 fp32: what the matmuls run in
    autocast: bool  # accelerate's bf16 autocast around the forward
    full_weights: int  # full fine-tuning: bytes of a stored parameter (4 fp32, 2 under ZeRO-3's bf16)
    adapter_storage: int  # adapters as stored and updated (2 or 4)
    adapter_compute: int  # adapters as they multiply (the gathered dtype under FSDP2 / ZeRO-3)
    fp32_residual: bool  # full fine-tuning's fp32 weights under autocast: the residual stream stays fp32
    packed: bool = True  # rows carry position_ids: transformers builds a block-diagonal mask for SDPA
    attention: str = "sdpa"  # the attention path (Strategy.attention): what a layer's attention saves
    # What the plan's total is measured by: on the CPU the process's resident set, which holds only the pages a
    # tensor has written (TRL's tile buffer, wider than a small vocabulary, is mostly never touched); on CUDA the
    # allocator's bytes. A measurement of allocated bytes on the CPU (scripts/bench_planner.py) sets it False.
    resident: bool = False


def runtime(job: Job, s: Strategy) -> Runtime:
    """What the trainer runs for this job and strategy (see the module docstring)."""
    compute = 2 if job.method.dtype_on(job.hw.device) == "bf16" else 4
    engine = s.engine
    autocast = compute == 2 and not engine.deepspeed
    full_weights = 2 if engine.deepspeed and compute == 2 else 4
    stored = 4 if job.method.adapter_dtype == "fp32" else 2
    if engine.deepspeed:
        stored = adapter_compute = compute  # DeepSpeed's bf16 casts every parameter
    else:
        # accelerate's fsdp2_prepare_model upcasts trainable parameters to fp32, except in a model holding
        # bitsandbytes' Params4bit (fsdp_utils.py: `not model_has_params4bit`); FSDP2 gathers them in bf16
        if engine.fp32_trainable and not job.method.spec.quantized_base:
            stored = 4
        adapter_compute = compute if engine.shards else stored
    fp32_residual = (
        job.method.spec.trains_base_weights and full_weights == 4 and autocast and not engine.shards
    )
    return Runtime(
        engine, job.hw.device, compute, autocast, full_weights, stored, adapter_compute, fp32_residual,
        # a split drops the attention mask (Ulysses: causality from position_ids; ring: no packed rows)
        packed=takes_mask(s),
        attention=s.attention,
        resident=job.hw.device == "cpu",
    )  # fmt: skip


def rank_tokens(job: Job, s: Strategy) -> int:
    """Tokens of one micro-batch that each rank holds (every sequence of its examples: DPO's chosen and
    rejected): the sequences' share under a split."""
    return math.ceil(micro_batch_rows(job, s) * job.seq_len / s.sequence_parallel)


def state_shards(job: Job, s: Strategy) -> int:
    return s.mesh(job.hw.total_gpus).state_shards
