"""The pre-flight planner: typed configs in, a frozen `Plan` out.

Pure: no torch, no I/O beyond the calibration constants shipped with the
package, no GPU query. Memory is per GPU in decimal GB (1e9 bytes), term by
term, following DESIGN.md's memory model; the strategy is the first rung of
the ladder (activation checkpointing, chunked loss, smaller micro-batch,
data parallel, sharding, 8-bit optimizer, optimizer offload, parameter
offload) on which the job fits with headroom. Settings the user fixed are
never changed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from finetune.config import HardwareConfig, MethodConfig, ModelConfig, PlanConfig, TrainConfig
from finetune.errors import PlanError
from finetune.planner._activations import (
    autocast_weight_copy_bytes,
    layer_bytes_per_token,
    model_bytes_per_token,
)
from finetune.planner.params import ParamCounts, count_params, lora_params, projection_shapes

GB = 1e9
HOURS_PER_MONTH = 730.0


@dataclass(frozen=True)
class Calibration:
    """Constants the architecture cannot give; see calibration.json."""

    cuda_context_gb: float
    cpu_process_gb: float
    allocator_fraction: float
    plain_loss_peak_factor: float
    chunked_loss_peak_factor: float
    quant_constant_bits: float
    qlora_dequant_time_factor: float
    offload_pcie_gb_per_s: float
    cpu_adam_params_per_s: float
    host_gb_per_rank: float
    default_tokens_per_micro_batch: int
    backward_working_set_layers: float

    @staticmethod
    @lru_cache(maxsize=1)
    def default() -> Calibration:
        raw = json.loads((Path(__file__).with_name("calibration.json")).read_text())
        return Calibration(**{k: v for k, v in raw.items() if not k.startswith("_")})


# ---------------------------------------------------------------- the Plan


@dataclass(frozen=True)
class Strategy:
    sharding: str = "none"  # none | ddp | fsdp | zero3
    offload_optimizer: bool = False
    offload_params: bool = False
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    chunked_loss: bool = False
    micro_batch_size: int = 1
    grad_accum_steps: int = 1


@dataclass(frozen=True)
class Memory:
    weights: float
    trainable_state: float
    activations: float
    logits: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.trainable_state + self.activations + self.logits + self.overhead

    def as_dict(self) -> dict[str, float]:
        d = {k: round(v, 3) for k, v in asdict(self).items()}
        d["total"] = round(self.total, 3)
        return d


@dataclass(frozen=True)
class Estimate:
    tokens_per_second: Optional[float]
    step_seconds: Optional[float]
    run_hours: Optional[float]
    usd: Optional[float]


@dataclass(frozen=True)
class Alternative:
    hardware: str
    fits: bool
    total_gb: float
    usd_per_month: Optional[float]


@dataclass(frozen=True)
class Plan:
    fits: bool
    hardware: HardwareConfig
    params_total: int
    params_trainable: int
    strategy: Strategy
    gpu_memory: Memory
    host_memory_gb: float
    disk_checkpoint_gb: float
    disk_export_gb: float
    estimate: Estimate
    seq_len: int
    reasons: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    usable_gpu_memory_gb: float = 0.0
    merge_host_memory_gb: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The plan contract of DESIGN.md (sizes in decimal GB, per GPU unless named otherwise)."""
        hw = self.hardware
        return {
            "fits": self.fits,
            "hardware": {
                "name": hw.name,
                "gpus": hw.total_gpus,
                "gpu_memory_gb": hw.gpu_memory_gb,
                "host_memory_gb": hw.host_memory_gb,
                "usd_per_month": hw.usd_per_month,
            },
            "params": {"total": self.params_total, "trainable": self.params_trainable},
            "strategy": asdict(self.strategy),
            "gpu_memory_gb": self.gpu_memory.as_dict(),
            "host_memory_gb": round(self.host_memory_gb, 3),
            "disk_gb": {
                "checkpoint": round(self.disk_checkpoint_gb, 3),
                "export": round(self.disk_export_gb, 3),
            },
            "estimate": {k: (None if v is None else round(v, 4)) for k, v in asdict(self.estimate).items()},
            "reasons": list(self.reasons),
            "suggestions": list(self.suggestions),
            "alternatives": [asdict(a) for a in self.alternatives],
            "seq_len": self.seq_len,
            "usable_gpu_memory_gb": round(self.usable_gpu_memory_gb, 3),
            "merge_host_memory_gb": round(self.merge_host_memory_gb, 3),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], hardware: HardwareConfig) -> Plan:
        """`to_dict`'s output back into a Plan (workers read plan.json; they never re-plan).

        The contract names the profile but not all of it, so the caller passes the resolved profile.
        """
        return cls(
            fits=d["fits"],
            hardware=hardware,
            params_total=d["params"]["total"],
            params_trainable=d["params"]["trainable"],
            strategy=Strategy(**d["strategy"]),
            gpu_memory=Memory(**{k: v for k, v in d["gpu_memory_gb"].items() if k != "total"}),
            host_memory_gb=d["host_memory_gb"],
            disk_checkpoint_gb=d["disk_gb"]["checkpoint"],
            disk_export_gb=d["disk_gb"]["export"],
            estimate=Estimate(**d["estimate"]),
            seq_len=d["seq_len"],
            reasons=tuple(d.get("reasons", ())),
            suggestions=tuple(d.get("suggestions", ())),
            alternatives=tuple(Alternative(**a) for a in d.get("alternatives", ())),
            usable_gpu_memory_gb=d.get("usable_gpu_memory_gb", 0.0),
            merge_host_memory_gb=d.get("merge_host_memory_gb", 0.0),
        )


# ---------------------------------------------------------------- memory terms


@dataclass(frozen=True)
class _Job:
    """Everything the memory terms depend on, resolved."""

    model: ModelConfig
    method: MethodConfig
    hw: HardwareConfig
    train: TrainConfig
    seq_len: int
    counts: ParamCounts
    adapter: int  # LoRA parameters (0 for full fine-tuning)
    cal: Calibration

    @property
    def trainable(self) -> int:
        return self.counts.total if self.method.name == "full" else self.adapter


def _optimizer_bytes(optimizer: str) -> float:
    """Adam moments, bytes per trainable parameter: fp32 m and v, or 8-bit (saves ~6 bytes)."""
    return 8.0 if optimizer == "adamw" else 2.0


def _dtype_bytes(job: _Job) -> float:
    return 4.0 if job.method.dtype_on(job.hw.device) == "fp32" else 2.0


def _fp32_autocast(job: _Job, s: Strategy) -> bool:
    """Full fine-tuning as the trainer runs it without DeepSpeed or FSDP: fp32 weights under bf16 autocast.

    (finetune/train/models.py; HF Trainer with bf16=True.) The same 16 bytes a parameter as DESIGN.md's
    mixed precision, split 4 + 4 + 8 (weights, which are their own master copy; gradients; moments)
    instead of 2 + 2 + 4 + 8, and different activations: an fp32 residual stream, and autocast's bf16
    copy of each weight saved for backward. DeepSpeed and FSDP keep 16-bit working weights instead.
    """
    return (
        job.method.name == "full"
        and _dtype_bytes(job) == 2.0
        and s.sharding in ("none", "ddp")
        and not (s.offload_optimizer or s.offload_params)
    )


def _base_weight_bytes(job: _Job) -> float:
    """The frozen (or, for full fine-tuning, the bf16 working) copy of the base model."""
    c = job.counts
    if job.method.name == "qlora":
        bits = 4.0 + job.cal.quant_constant_bits
        return c.linear * bits / 8.0 + 2.0 * c.kept_16bit
    return _dtype_bytes(job) * c.total


def _trainable_state_bytes(job: _Job, s: Strategy) -> tuple[float, float]:
    """(on GPU, offloaded to host) bytes of the training state of the trainable parameters.

    Full fine-tuning: grads + fp32 master + Adam moments (the bf16 weights are the `weights` term).
    Adapters: their weights too, since the base is frozen: fp32 adapters 4 + 4 + 8, bf16 adapters
    2 + 2 + 4 (fp32 master) + 8; about 16 bytes a parameter either way.
    """
    n = job.trainable
    moments = _optimizer_bytes(s.optimizer)
    if job.method.name == "full":
        weight, grad = 0.0, 4.0 if _fp32_autocast(job, s) else _dtype_bytes(job)
        master = 0.0 if grad == 4.0 else 4.0
    else:
        weight = grad = 4.0 if job.method.adapter_dtype == "fp32" else 2.0
        master = 4.0 if weight == 2.0 else 0.0
    offloaded = (master + moments) * n if s.offload_optimizer else 0.0
    on_gpu = (weight + grad) * n + (0.0 if s.offload_optimizer else (master + moments) * n)
    if s.sharding == "ddp":
        on_gpu += grad * n  # DDP's gradient buckets hold a second copy of the gradients
    return on_gpu, offloaded


def _layer_bytes_per_token(job: _Job, checkpointing: bool, autocast: bool = False) -> float:
    """Saved activation bytes of one decoder layer per token (the fitted formulas of `_activations`)."""
    m = job.model
    return layer_bytes_per_token(
        hidden=m.hidden_size,
        intermediate=m.intermediate_size,
        heads=m.num_heads,
        kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        method=job.method.name,
        adapter_bytes=4 if job.method.adapter_dtype == "fp32" else 2,
        lora_dropout=job.method.uses_adapters and job.method.lora_dropout > 0,
        attention_bias=m.attention_bias,
        lora_rank=job.method.lora_rank,
        checkpointing=checkpointing,
        autocast=autocast,
    )


def _model_bytes_per_token(job: _Job, s: Strategy) -> float:
    """Kept once per model per token: the final norm and the head's input (the loss is the `logits` term)."""
    return model_bytes_per_token(
        hidden=job.model.hidden_size,
        vocab=job.model.vocab_size,
        plain_loss=False,
        trainable_head=job.method.name == "full",
        chunked_loss=s.chunked_loss,
        autocast=_fp32_autocast(job, s),
    )


def _activation_bytes(job: _Job, s: Strategy) -> float:
    """Activations saved for backward across the step.

    With checkpointing, each layer's input only: the layer being recomputed is transient and never
    coincides with the loss peak, so the overhead's working set counts it (`_working_set_bytes`).
    Under fp32 autocast (`_fp32_autocast`), also the bf16 weight copies of every layer (without
    checkpointing) and of the LM head (the model runs its head under autocast; with the chunked loss
    on zero rows, `logits_to_keep` empty, which still casts and saves the whole weight: measured).
    """
    m = job.model
    autocast = _fp32_autocast(job, s)
    per_token = _layer_bytes_per_token(job, s.activation_checkpointing, autocast) * m.num_layers
    per_token += _model_bytes_per_token(job, s)
    held = per_token * s.micro_batch_size * job.seq_len
    if autocast:
        if not s.activation_checkpointing:
            held += autocast_weight_copy_bytes(job.counts.linear_per_layer) * m.num_layers
        held += autocast_weight_copy_bytes(m.vocab_size * m.hidden_size)
    return held


def _logit_bytes(job: _Job, s: Strategy) -> float:
    """Peak of the loss: the fp32 logits and their gradient (one chunk at a time when chunked).

    Measured (scripts/bench_planner.py): a plain loss peaks at 3x the fp32 logits (log-softmax output,
    its gradient and the input gradient at once); the chunked loss at 1.5x one chunk of fp32 logits
    (the chunk in bf16 and its fp32 copy, then the fp32 gradient and its bf16 cast; 1x in fp32),
    plus its hidden-state gradient buffer, the chunk's hidden rows and their gradient and, when the head
    trains, one head-gradient accumulator, all in the compute dtype.
    """
    tokens = s.micro_batch_size * job.seq_len
    vocab = job.model.vocab_size
    if s.chunked_loss:
        rows = min(tokens, job.train.loss_chunk_size)
        # fp32 autocast: the loss runs outside autocast on fp32 hidden states and an fp32 head
        buf = 4.0 if _fp32_autocast(job, s) else _dtype_bytes(job)
        # an fp32 chunk needs no 16-bit copy or cast: its logits, then their gradient (measured 1.03-1.04)
        factor = job.cal.chunked_loss_peak_factor if buf == 2.0 else 1.0
        peak = factor * 4.0 * rows * vocab
        # the hidden-state gradient buffer, and the chunk's rows of hidden states and of their gradient
        peak += buf * (tokens + 2 * rows) * job.model.hidden_size
        if job.method.name == "full":
            peak += buf * vocab * job.model.hidden_size  # one accumulator for the head gradient
        return peak
    return job.cal.plain_loss_peak_factor * 4.0 * tokens * vocab


def _memory(job: _Job, s: Strategy) -> tuple[Memory, float]:
    """Per-GPU memory terms (GB) and host memory offloaded per GPU (bytes)."""
    shards = job.hw.total_gpus if s.sharding in ("fsdp", "zero3") else 1
    weights = 4.0 * job.counts.total if _fp32_autocast(job, s) else _base_weight_bytes(job)
    state_gpu, state_host = _trainable_state_bytes(job, s)
    host = state_host / shards
    if s.offload_params:
        host += weights / shards
        weights = 0.0
    else:
        weights /= shards
    if shards > 1:
        # The gathered full weights of the layer being computed and the next one (prefetch).
        layer_bytes = _base_weight_bytes(replace(job, counts=_one_layer(job.counts)))
        weights += 2 * layer_bytes
    state_gpu /= shards
    activations = _activation_bytes(job, s)
    logits = _logit_bytes(job, s)
    fixed = job.cal.cuda_context_gb * GB if job.hw.device == "cuda" else job.cal.cpu_process_gb * GB
    working_set = _working_set_bytes(job, s, logits)
    overhead = fixed + working_set + job.cal.allocator_fraction * (weights + state_gpu + activations + logits)
    mem = Memory(
        weights=weights / GB,
        trainable_state=state_gpu / GB,
        activations=activations / GB,
        logits=logits / GB,
        overhead=overhead / GB,
    )
    return mem, host


def _working_set_bytes(job: _Job, s: Strategy, logit_bytes: float) -> float:
    """Transient bytes of a layer's backward, beyond the loss peak (measured by scripts/bench_planner.py).

    The gradients of one layer's activations while its backward runs: 0.2-0.5 of that layer's saved
    activations on top of what the activation term keeps. With activation checkpointing, the layer being
    recomputed holds its full saved activations meanwhile (DESIGN.md's "one layer's full activations
    while it is recomputed"). QLoRA adds one projection dequantized to the compute dtype (bitsandbytes
    dequantizes each 4-bit weight for its matmul, forward and backward). None of these coincides with
    the loss peak (the loss is done before the first layer's backward), so only the part above the
    `logits` term is added.
    """
    tokens = s.micro_batch_size * job.seq_len
    autocast = _fp32_autocast(job, s)
    layer = _layer_bytes_per_token(job, checkpointing=False, autocast=autocast) * tokens
    working = job.cal.backward_working_set_layers * (layer + _model_bytes_per_token(job, s) * tokens)
    if s.activation_checkpointing:
        working += layer  # the layer being recomputed
        if autocast:
            working += autocast_weight_copy_bytes(job.counts.linear_per_layer)  # and its weight copies
    if job.method.name == "qlora":
        compute_bytes = 4.0 if job.method.quant_compute_dtype_on(job.hw.device) == "fp32" else 2.0
        working += compute_bytes * max(d_in * d_out for d_in, d_out in projection_shapes(job.model).values())
    return max(0.0, working - logit_bytes)


def _one_layer(c: ParamCounts) -> ParamCounts:
    return ParamCounts(
        embedding=0,
        lm_head=0,
        linear_per_layer=c.linear_per_layer,
        other_per_layer=c.other_per_layer,
        final_norm=0,
        num_layers=1,
    )


# ---------------------------------------------------------------- strategy ladder


def _usable_gb(hw: HardwareConfig, headroom: float) -> float:
    assert hw.gpu_memory_gb is not None
    return hw.gpu_memory_gb * (1.0 - headroom)


def _host_needed_gb(job: _Job, host_offloaded_per_gpu: float) -> float:
    """Host RAM per node: offloaded state of every local rank plus each rank's process."""
    per_node = job.hw.gpus_per_node
    return (host_offloaded_per_gpu * per_node) / GB + job.cal.host_gb_per_rank * per_node


def _fits(job: _Job, s: Strategy, headroom: float) -> tuple[bool, Memory, float]:
    mem, host = _memory(job, s)
    host_gb = _host_needed_gb(job, host)
    ok = mem.total <= _usable_gb(job.hw, headroom)
    if job.hw.host_memory_gb is not None and (s.offload_optimizer or s.offload_params):
        ok = ok and host_gb <= job.hw.host_memory_gb
    return ok, mem, host_gb


def _start_micro_batch(job: _Job) -> int:
    t = job.train
    if t.micro_batch_size is not None:
        return t.micro_batch_size
    per_rank = max(1, t.batch_size // job.hw.total_gpus)
    target = max(1, job.cal.default_tokens_per_micro_batch // job.seq_len)
    return max(1, min(per_rank, target))


def _ladder(job: _Job) -> list[tuple[str, Strategy]]:
    """Candidate strategies in DESIGN.md's order, each rung adding one memory saving to the last.

    A setting the user fixed (non-None in the config) is applied from the start and never changed.
    """
    t, hw = job.train, job.hw
    shard_engine = "zero3" if t.engine == "deepspeed" else "fsdp"
    multi = hw.total_gpus > 1
    s = Strategy(
        sharding=t.sharding if t.sharding is not None else ("ddp" if multi else "none"),
        offload_optimizer=bool(t.offload_optimizer),
        offload_params=bool(t.offload_params),
        optimizer=job.method.optimizer or "adamw",
        activation_checkpointing=bool(t.activation_checkpointing),
        chunked_loss=bool(t.chunked_loss),
        micro_batch_size=_start_micro_batch(job),
    )
    rungs: list[tuple[str, Strategy]] = [("as configured", s)]

    def step(reason: str, **changes: Any) -> None:
        nonlocal s
        new = replace(s, **changes)
        if new != s:
            s = new
            rungs.append((reason, s))

    if t.activation_checkpointing is None:
        step("activation checkpointing", activation_checkpointing=True)
    if t.chunked_loss is None:
        step("chunked loss", chunked_loss=True)
    if t.micro_batch_size is None:
        mbs = s.micro_batch_size
        while mbs > 1:
            mbs //= 2
            step(f"micro-batch {mbs} with more gradient accumulation", micro_batch_size=mbs)
    if t.sharding is None and multi:
        step(f"{shard_engine} full shard across {hw.total_gpus} GPUs", sharding=shard_engine)
    # bitsandbytes' 8-bit optimizers have no DTensor support: FSDP2 cannot run them (measured: "Operator
    # bitsandbytes.optimizer_update_32bit.default does not have a sharding strategy registered").
    if job.method.optimizer is None and hw.device == "cuda" and s.sharding != "fsdp":
        step("8-bit optimizer states", optimizer="adamw_8bit")
    sharded_or_single = s.sharding != "ddp"
    if t.offload_optimizer is None and sharded_or_single:
        step("optimizer offload to CPU", offload_optimizer=True)
    if t.offload_params is None and s.sharding in ("fsdp", "zero3"):
        step("parameter offload to CPU", offload_params=True)
    return rungs


def _largest_micro_batch(job: _Job, s: Strategy, headroom: float) -> Strategy:
    """After a fit at a small micro-batch, take the largest one up to the starting size that still fits."""
    if job.train.micro_batch_size is not None:
        return s
    best = s
    mbs = s.micro_batch_size * 2
    while mbs <= _start_micro_batch(job):
        cand = replace(s, micro_batch_size=mbs)
        if not _fits(job, cand, headroom)[0]:
            break
        best, mbs = cand, mbs * 2
    return best


def _with_accumulation(job: _Job, s: Strategy) -> Strategy:
    if job.train.grad_accum_steps is not None:
        return replace(s, grad_accum_steps=job.train.grad_accum_steps)
    ranks = job.hw.total_gpus
    return replace(s, grad_accum_steps=max(1, math.ceil(job.train.batch_size / (s.micro_batch_size * ranks))))


# ---------------------------------------------------------------- estimates


def _estimate(job: _Job, s: Strategy, mfu: float) -> tuple[Estimate, list[str]]:
    notes: list[str] = []
    hw, m = job.hw, job.model
    if hw.peak_bf16_tflops is None:
        return Estimate(None, None, None, None), [f"no time estimate: profile {hw.name} has no peak FLOP/s"]
    n = job.counts.total
    # 6N a token for full fine-tuning; frozen weights need no weight gradient (4N); recomputation adds 2N.
    flops_per_token = (6.0 if job.method.name == "full" else 4.0) * n
    if s.activation_checkpointing:
        flops_per_token += 2.0 * n
    # Attention scores and values: 4 x layers x seq x (heads x head_dim) forward, causal halves it, x3 with backward.
    flops_per_token += 6.0 * m.num_layers * job.seq_len * m.num_heads * m.head_dim
    if job.method.name == "qlora":
        flops_per_token *= job.cal.qlora_dequant_time_factor
    tokens_per_second = mfu * hw.peak_bf16_tflops * 1e12 * hw.total_gpus / flops_per_token
    step_tokens = s.micro_batch_size * s.grad_accum_steps * hw.total_gpus * job.seq_len
    step_seconds = step_tokens / tokens_per_second
    if s.offload_optimizer:
        shards = hw.total_gpus if s.sharding in ("fsdp", "zero3") else 1
        local = job.trainable / shards
        # The optimizer runs on the CPU and grads/weights cross PCIe every step.
        step_seconds += local / job.cal.cpu_adam_params_per_s + 4.0 * local / (
            job.cal.offload_pcie_gb_per_s * GB
        )
        notes.append(
            "optimizer offload: the optimizer step runs on the CPU (estimate includes PCIe and CPU Adam time)"
        )
    if s.offload_params:
        step_seconds += 3 * 2.0 * job.counts.total / hw.total_gpus / (job.cal.offload_pcie_gb_per_s * GB)
    tokens_per_second = step_tokens / step_seconds
    t = job.train
    run_tokens: Optional[float] = None
    if t.max_steps > 0:
        run_tokens = float(t.max_steps * step_tokens)
    elif t.dataset_tokens is not None:
        run_tokens = t.epochs * t.dataset_tokens
    else:
        notes.append(
            "no run-length estimate: set train.max_steps or train.dataset_tokens, or run mode=data first"
        )
    if run_tokens is None:
        return Estimate(tokens_per_second, step_seconds, None, None), notes
    hours = run_tokens / tokens_per_second / 3600.0
    usd = None if hw.usd_per_month is None else hours * hw.usd_per_month * hw.nodes / HOURS_PER_MONTH
    return Estimate(tokens_per_second, step_seconds, hours, usd), notes


def _disk(job: _Job, s: Strategy) -> tuple[float, float]:
    """(one resumable checkpoint, the export) in GB."""
    n, a = job.counts.total, job.adapter
    if job.method.name == "full":
        weights = _dtype_bytes(job)
        master = 0.0 if weights == 4.0 else 4.0
        checkpoint = (weights + master + _optimizer_bytes(s.optimizer)) * n
        export = 2.0 * n
    else:
        adapter = 4.0 if job.method.adapter_dtype == "fp32" else 2.0
        checkpoint = (adapter + 4.0 * (adapter == 2.0) + _optimizer_bytes(s.optimizer)) * a
        export = 2.0 * n + 2.0 * a  # merged bf16 weights, and the adapter alone
    return checkpoint / GB, export / GB


# ---------------------------------------------------------------- entry points


def _resolve_seq_len(model: ModelConfig, train: TrainConfig, seq_len: Optional[int]) -> int:
    value = seq_len if seq_len is not None else train.seq_len
    if value == "auto" or not isinstance(value, int):
        raise PlanError("train.seq_len=auto needs the data stage: run mode=data (or mode=all) first")
    if value > model.max_position_embeddings:
        raise PlanError(
            f"train.seq_len={value} exceeds model.max_position_embeddings={model.max_position_embeddings} of {model.name}"
        )
    return value


def _plan_on(
    model: ModelConfig,
    method: MethodConfig,
    hw: HardwareConfig,
    train: TrainConfig,
    plan_cfg: PlanConfig,
    seq_len: int,
    cal: Calibration,
) -> Plan:
    if hw.gpu_memory_gb is None:
        raise PlanError(f"hardware.gpu_memory_gb is unknown for profile {hw.name!r}; set it")
    if train.sharding in ("fsdp", "zero3", "ddp") and hw.total_gpus == 1:
        raise PlanError(f"train.sharding={train.sharding} needs several GPUs; hardware={hw.name} has one")
    counts = count_params(model)
    adapter = lora_params(model, method) if method.uses_adapters else 0
    job = _Job(model, method, hw, train, seq_len, counts, adapter, cal)
    usable = _usable_gb(hw, plan_cfg.headroom)

    reasons: list[str] = []
    chosen: Optional[tuple[Strategy, Memory, float]] = None
    last: Optional[tuple[Strategy, Memory, float]] = None
    for why, s in _ladder(job):
        ok, mem, host_gb = _fits(job, s, plan_cfg.headroom)
        if last is not None:
            reasons.append(f"{why}: {last[1].total:,.1f} -> {mem.total:,.1f} GB per GPU")
        last = (s, mem, host_gb)
        if ok:
            chosen = last
            break
    fits = chosen is not None
    s, mem, host_gb = chosen if chosen is not None else last  # type: ignore[misc]
    if fits:
        if not reasons:
            reasons.append(f"fits as configured: {mem.total:,.1f} GB of {usable:,.1f} GB usable per GPU")
        s = _largest_micro_batch(job, s, plan_cfg.headroom)
        _, mem, host_gb = _fits(job, s, plan_cfg.headroom)
    else:
        reasons.append(_biggest_term(mem, usable))
        if hw.host_memory_gb is not None and host_gb > hw.host_memory_gb:
            reasons.append(
                f"host memory: offload needs {host_gb:,.0f} GB > {hw.host_memory_gb:,.0f} GB on {hw.name}"
            )
    s = _with_accumulation(job, s)
    effective = s.micro_batch_size * s.grad_accum_steps * hw.total_gpus
    if effective != train.batch_size:
        reasons.append(f"effective batch {effective} sequences (train.batch_size={train.batch_size})")
    estimate, notes = _estimate(job, s, plan_cfg.mfu)
    reasons.extend(notes)
    checkpoint_gb, export_gb = _disk(job, s)
    merge_host = (2.0 * counts.total) / GB + cal.host_gb_per_rank if method.uses_adapters else 0.0
    if hw.host_memory_gb is not None and merge_host > hw.host_memory_gb:
        reasons.append(
            f"merging the adapter needs the bf16 base in host RAM ({merge_host:.0f} GB > {hw.host_memory_gb:.0f} GB): "
            "merge on a larger host or serve the adapter"
        )
    return Plan(
        fits=fits,
        hardware=hw,
        params_total=counts.total,
        params_trainable=job.trainable,
        strategy=s,
        gpu_memory=mem,
        host_memory_gb=host_gb,
        disk_checkpoint_gb=checkpoint_gb,
        disk_export_gb=export_gb,
        estimate=estimate,
        seq_len=seq_len,
        reasons=tuple(reasons),
        usable_gpu_memory_gb=usable,
        merge_host_memory_gb=merge_host,
    )


def _biggest_term(mem: Memory, usable: float) -> str:
    terms = {k: v for k, v in mem.as_dict().items() if k != "total"}
    name, value = max(terms.items(), key=lambda kv: kv[1])
    return (
        f"does not fit even with every memory saving: {mem.total:.1f} GB per GPU > {usable:.1f} GB usable; "
        f"largest term is {name} ({value:.1f} GB)"
    )


def _suggestions(
    plan: Plan,
    model: ModelConfig,
    method: MethodConfig,
    train: TrainConfig,
    plan_cfg: PlanConfig,
    alts: list[Plan],
    cal: Calibration,
) -> list[str]:
    out: list[str] = []
    fitting = sorted((a for a in alts if a.fits), key=lambda a: a.hardware.usd_per_month or math.inf)
    if fitting:
        a = fitting[0]
        usd = a.hardware.usd_per_month
        price = "price unknown" if usd is None else f"{usd:,.0f} USD/month"
        out.append(f"hardware={a.hardware.name} fits ({a.gpu_memory.total:.1f} GB per GPU, {price})")
    if method.name == "lora":
        q = _plan_on(model, replace(method, name="qlora"), plan.hardware, train, plan_cfg, plan.seq_len, cal)
        if q.fits:
            out.append(f"method=qlora fits on {plan.hardware.name} ({q.gpu_memory.total:.1f} GB per GPU)")
    if method.name == "full":
        lo = _plan_on(
            model,
            replace(method, name="lora", optimizer=None),
            plan.hardware,
            train,
            plan_cfg,
            plan.seq_len,
            cal,
        )
        if lo.fits:
            out.append(f"method=lora fits on {plan.hardware.name} ({lo.gpu_memory.total:.1f} GB per GPU)")
    seq = plan.seq_len // 2
    while seq >= 256:
        shorter = _plan_on(model, method, plan.hardware, train, plan_cfg, seq, cal)
        if shorter.fits:
            out.append(
                f"train.seq_len={seq} fits on {plan.hardware.name} ({shorter.gpu_memory.total:.1f} GB per GPU)"
            )
            break
        seq //= 2
    return out


def make_plan(
    model: ModelConfig,
    method: MethodConfig,
    hardware: HardwareConfig,
    train: TrainConfig,
    plan_cfg: PlanConfig,
    profiles: dict[str, HardwareConfig],
    *,
    seq_len: Optional[int] = None,
    calibration: Optional[Calibration] = None,
) -> Plan:
    """Plan the job. `profiles` are the hardware profiles to weigh as alternatives (and for `auto`).

    `seq_len` overrides `train.seq_len` (the data stage resolves `auto` to the longest kept sequence).
    """
    cal = calibration or Calibration.default()
    n = _resolve_seq_len(model, train, seq_len)
    gpu_profiles = [p for p in profiles.values() if p.device == "cuda" and p.gpu_memory_gb is not None]
    unpriced: list[str] = []
    if hardware.is_auto:
        names = hardware.candidates or [p.name for p in gpu_profiles]
        unknown = [name for name in names if name not in profiles]
        if unknown:
            raise PlanError(f"hardware.candidates names unknown profiles: {', '.join(unknown)}")
        # Without a known price a profile cannot be the cheapest: auto weighs the priced ones only.
        unpriced = [name for name in names if profiles[name].usd_per_month is None]
        gpu_profiles = [profiles[name] for name in names if name not in unpriced]
        if not gpu_profiles:
            raise PlanError(
                f"hardware=auto: no candidate has a known price (usd_per_month): {', '.join(names)}"
            )
    alts = [_plan_on(model, method, p, _train_for(train, p), plan_cfg, n, cal) for p in gpu_profiles]
    if hardware.is_auto:
        fitting = [a for a in alts if a.fits]
        if fitting:
            plan = min(fitting, key=lambda a: (a.hardware.usd_per_month or math.inf, a.gpu_memory.total))
            plan = replace(
                plan,
                reasons=(f"hardware=auto: {plan.hardware.name} is the cheapest profile that fits",)
                + plan.reasons,
            )
        else:
            plan = min(alts, key=lambda a: a.gpu_memory.total / (a.hardware.gpu_memory_gb or 1))
            plan = replace(plan, reasons=("hardware=auto: no profile fits",) + plan.reasons)
        if unpriced:
            skipped = f"hardware=auto: skipped {', '.join(unpriced)} (price unknown)"
            plan = replace(plan, reasons=plan.reasons[:1] + (skipped,) + plan.reasons[1:])
    else:
        plan = _plan_on(model, method, hardware, train, plan_cfg, n, cal)
    alternatives = tuple(
        Alternative(a.hardware.name, a.fits, round(a.gpu_memory.total, 3), a.hardware.usd_per_month)
        for a in sorted(alts, key=lambda a: (a.hardware.usd_per_month or math.inf, a.hardware.name))
    )
    suggestions = () if plan.fits else tuple(_suggestions(plan, model, method, train, plan_cfg, alts, cal))
    return replace(plan, alternatives=alternatives, suggestions=suggestions)


def _train_for(train: TrainConfig, hw: HardwareConfig) -> TrainConfig:
    """A user-fixed sharding that a profile cannot honour (several GPUs on one) is dropped for that alternative."""
    if hw.total_gpus == 1 and train.sharding in ("ddp", "fsdp", "zero3"):
        return replace(train, sharding=None)
    return train


__all__ = ["Alternative", "Calibration", "Estimate", "Memory", "Plan", "Strategy", "make_plan"]
