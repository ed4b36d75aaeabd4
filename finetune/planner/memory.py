"""The memory model: per-GPU bytes of a job under a strategy, term by term, as the trainer really runs it.

`Runtime` says what runs (the engine, the dtypes, autocast), derived from the
job and strategy by `runtime()` exactly as finetune/train sets the run up;
measurement scripts may describe what their own harness ran instead. `memory()`
returns the contract's terms (decimal GB) and the bytes offloaded to host RAM.

What runs, per engine (finetune/modeling/models.py; accelerate and DeepSpeed at the
versions of ARCHITECTURE.md, "Checked against"; MEMORY_MODEL.md has the tables):

- one process / DDP: accelerate's bf16 autocast around the forward. Full
  fine-tuning holds fp32 weights (their own master copy), fp32 gradients and the
  moments: 4 + 4 + 8 bytes a parameter; the residual stream is fp32 and autocast
  saves a bf16 copy of each weight. Adapters in `method.adapter_dtype`: fp32
  ones 4 + 4 + 8 (PEFT casts each adapter input to fp32, autocast casts it
  back); bf16 ones keep no fp32 master copy with torch's AdamW and bf16
  moments: 2 + 2 + 4. DDP adds its gradient buckets.
- FSDP2: accelerate upcasts every trainable parameter to fp32 and shards it
  (not when the model holds bitsandbytes' 4-bit weights: QLoRA's adapters stay
  in their dtype); MixedPrecisionPolicy gathers each layer in bf16 for compute
  (so activations are bf16's, adapters compute in bf16): 4 + 4 + 8 a trainable
  parameter over the shards, the frozen base in its dtype over the shards, two
  gathered layers, and the tail unit (final norm and LM head; with tied weights
  the embedding) held unsharded from the end of the forward to the start of the
  backward.
- ZeRO-3 (bf16): every parameter bf16, adapters too; fp32 master and moments in
  the optimizer's partitions: 2 + 2 + 4 + 8 over the shards, one fp32 gradient
  buffer for an optimizer sub-group, a reduce bucket, two gathered layers, and
  the LM head gathered whole for the loss. Optimizer offload puts the master
  weights, moments and gradient partitions in host RAM (18 bytes a trainable
  parameter: stage3.py's fp32 sub-group gradients and bf16 gradient partitions
  live there too).
- Sharded QLoRA (either engine): the 4-bit weights are stored in the compute
  dtype (bitsandbytes' `bnb_4bit_quant_storage`), so the engine divides and
  gathers them as stored, half a byte a weight; their quantization constants
  are no parameters (bitsandbytes keeps them in each weight's `quant_state`),
  so every rank holds all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from finetune.core.config import HardwareConfig, MethodConfig, ModelConfig, PlanConfig, TrainConfig
from finetune.core.objectives import OBJECTIVES, ObjectiveSpec
from finetune.core.parallelism import Engine
from finetune.planner.activations import (
    LayerRun,
    LayerShape,
    attention_mask_bytes,
    autocast_weight_copy_bytes,
    expert_weights,
    folded_expert_bytes,
    layer_bytes_per_token,
    model_bytes_per_token,
)
from finetune.planner.attention import path_bytes, takes_mask, workspace_above_loss
from finetune.planner.calibration import Calibration, DeviceCalibration
from finetune.planner.contract import GB, Memory, Strategy
from finetune.planner.params import ParamCounts, count_params, lora_params, projection_shapes

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
    # planner's choice on memory and time (None; `dpo.reference=auto`).
    precompute_reference: Optional[bool] = None
    # data.packing: rows packed from several samples (a sequence split must keep them apart)
    packing: bool = True

    @property
    def sequences(self) -> int:
        """Sequences one example puts through the model (DPO: its chosen and its rejected answer)."""
        return self.objective.sequences_per_example

    @property
    def reference_runs(self) -> bool:
        """A frozen reference model runs a forward every step (DPO), unless its log-probabilities are precomputed."""
        return self.objective.reference == "always"

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
        return replace(job, precompute_reference=self.precompute_reference)


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
    adapter = lora_params(model, method) if method.uses_adapters else 0
    return Job(
        model, method, hw, train, seq_len, count_params(model), adapter, cal or Calibration.default(),
        plan or PlanConfig(), objective or OBJECTIVES["sft"], packing=packing,
    )  # fmt: skip


def micro_batch_rows(job: Job, s: Strategy) -> int:
    """Sequences in one micro-batch: `micro_batch_size` examples, each putting `job.sequences` through the model
    (TRL's preference collator concatenates the chosen and the rejected rows into one batch)."""
    return s.micro_batch_size * job.sequences


def reference_copy(job: Job, s: Strategy) -> bool:
    """Full fine-tuning with a per-step reference holds a frozen copy of the starting model; adapters use the
    base with the adapter disabled, and precomputed log-probabilities need no model during training."""
    return job.reference_runs and job.method.spec.trains_base_weights and not s.precompute_reference


def reference_weights(job: Job, s: Strategy, rt: Runtime) -> tuple[float, float]:
    """(on each GPU, offloaded per GPU) bytes of the frozen reference copy: in the policy's parameter dtype (TRL
    builds it with `dtype=model.dtype`), sharded like the policy under ZeRO-3 and FSDP2 (`prepare_deepspeed` /
    `prepare_fsdp` take the engine's settings, parameter offload included)."""
    if not reference_copy(job, s):
        return 0.0, 0.0
    per = rt.compute if rt.engine.shards else rt.full_weights
    held = per * job.counts.total / _shards(job, s)
    return (0.0, held) if s.offload_params else (held, 0.0)


def reference_forward_peak(job: Job, s: Strategy, rt: Runtime) -> float:
    """The reference forward's transient peak (no saved activations: under no_grad each layer's tensors are
    freed as the next is made): one layer's forward tensors for the micro-batch, the hidden states in and
    out, and TRL's fused head's forward tile. It runs after the policy's forward, while the policy's
    activations are held, and is over before the backward starts."""
    if not job.reference_runs or s.precompute_reference:
        return 0.0
    tokens = micro_batch_rows(job, s) * job.seq_len
    m = job.model
    one_layer = _layer(job, rt, checkpointing=False) * tokens
    hidden = 2 * rt.compute * tokens * m.hidden_size
    tile = trl_tile_buffer(job, rt, tokens) + 24 * tokens
    gathered = (
        2 * rt.compute * _one_layer_params(job.counts) if reference_copy(job, s) and rt.engine.shards else 0
    )
    return one_layer + hidden + tile + gathered


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
        resident=job.hw.device == "cpu",
    )  # fmt: skip


def rank_tokens(job: Job, s: Strategy) -> int:
    """Tokens of one micro-batch that each rank holds (every sequence of its examples: DPO's chosen and
    rejected): the sequences' share under a split."""
    return math.ceil(micro_batch_rows(job, s) * job.seq_len / s.sequence_parallel)


def _shards(job: Job, s: Strategy) -> int:
    return s.mesh(job.hw.total_gpus).state_shards


def _base_bytes(job: Job, rt: Runtime) -> float:
    """The frozen base (adapters) or the stored weights (full fine-tuning), whole."""
    divided, whole = _base_parts(job, rt)
    return divided + whole


def _kept_bytes(job: Job) -> int:
    """Bytes of a value QLoRA keeps in 16 bits (embeddings, head, norms): its compute dtype's."""
    return 2 if job.method.quant_compute_dtype_on(job.hw.device) == "bf16" else 4


def _base_parts(job: Job, rt: Runtime) -> tuple[float, float]:
    """(what a sharded engine divides, what every rank holds whole) bytes of the base, unsharded.

    QLoRA: the 4-bit weights as stored (half a byte a weight in a float storage dtype) and the kept weights
    are parameters; the NF4 constants live in each weight's `quant_state` (bitsandbytes' Params4bit), which
    neither FSDP2 nor ZeRO-3 shards.
    """
    c, spec = job.counts, job.method.spec
    if spec.trains_base_weights:
        return float(rt.full_weights * c.total), 0.0
    if spec.quantized_base:
        constants = c.linear * quant_constant_bits(job.method.double_quant) / 8
        return c.linear * 4 / 8 + _kept_bytes(job) * c.kept_16bit, constants
    return float(rt.compute * c.total), 0.0


def _moment_bytes(optimizer: str, param_bytes: int) -> int:
    """Adam's two moments a parameter: in the parameter's dtype with torch's AdamW, 8-bit with bitsandbytes."""
    return 2 if optimizer != "adamw" else 2 * param_bytes


def trainable_state(job: Job, s: Strategy, rt: Runtime) -> tuple[float, float]:
    """(on each GPU, offloaded to host per GPU) bytes of the trainable parameters' training state.

    Full fine-tuning: gradients, master copy and moments (the stored weights are the `weights` term).
    Adapters: their weights too (the base is frozen).
    """
    n, shards = job.trainable, _shards(job, s)
    full = job.method.spec.trains_base_weights
    if rt.engine.deepspeed:
        weight = 0 if full else rt.compute  # adapters' partitions (full fine-tuning's are the weights term)
        grad = rt.compute
        master = 4 if rt.compute == 2 else 0
        moments = _moment_bytes(s.optimizer, 4)
        bucket = 2 * job.model.hidden_size**2  # the reduce bucket (reduce_bucket_size h x h), on the GPU
        if s.offload_optimizer:
            # on the host: master, moments, the fp32 gradients of each sub-group and the gradient partitions
            host = (master + moments + 4 + grad) * n / shards
            if s.offload_params:
                return bucket, host + weight * n / shards
            return weight * n / shards + bucket, host
        sub_group = 4 * min(ZERO3_SUB_GROUP, n / shards)  # fp32 gradients of one optimizer sub-group
        return (weight + grad + master + moments) * n / shards + sub_group + bucket, 0.0
    # FSDP2: trainable parameters (fp32, but QLoRA's in their dtype), gradients and moments over the shards
    if rt.engine.shards:
        param = rt.full_weights if full else rt.adapter_storage
        weight = 0 if full else param
        per = weight + param + _moment_bytes(s.optimizer, param)
        if s.offload_optimizer:  # CPUOffloadPolicy: parameters, gradients and optimizer state together
            return 0.0, per * n / shards
        return per * n / shards, 0.0
    param = rt.full_weights if full else rt.adapter_storage
    weight = 0 if full else param
    on_gpu = (weight + param + _moment_bytes(s.optimizer, param)) * n
    if rt.engine.gradient_buckets:
        on_gpu += param * n  # DDP's gradient buckets hold a second copy of the gradients
    return on_gpu, 0.0


# Hub checkpoints come in safetensors shards of at most transformers' default max_shard_size ("5GB").
CHECKPOINT_SHARD_BYTES = 5e9


def load_host_bytes(job: Job, s: Strategy) -> float:
    """Host RAM per node while the ranks load the model, before any optimizer state exists.

    One process and DDP: every rank builds the whole model in host RAM (fp32 for full fine-tuning, the
    compute dtype for LoRA) before the trainer moves it to its GPU. QLoRA quantizes straight onto its GPU
    (a device map), one checkpoint shard at a time. ZeRO-3 loads under zero.Init (finetune/train/stage.py
    builds the DeepSpeed config first): each rank holds one shard at a time and keeps its partition.
    FSDP2 with cpu_ram_efficient_loading: the node's first rank loads the whole model, the others start
    empty, and it is broadcast.
    """
    per_node, spec = job.hw.gpus_per_node, job.method.spec
    load_dtype = 4 if spec.trains_base_weights else (2 if job.method.dtype_on(job.hw.device) == "bf16" else 4)
    whole = float(load_dtype * job.counts.total)
    shard = min(whole, CHECKPOINT_SHARD_BYTES)
    if spec.quantized_base and s.engine.shards and not s.engine.deepspeed:
        # accelerate's FSDP2 skips cpu_ram_efficient_loading for Params4bit: each rank quantizes the whole
        # model on the CPU, a shard of the checkpoint at a time, and fully_shard divides it afterwards
        return per_node * (_base_bytes(job, runtime(job, s)) + shard)
    if spec.quantized_base or s.engine.loading == "partitioned":
        # QLoRA on one GPU, DDP or ZeRO-3 quantizes straight onto the GPU (`load_gpu_bytes`)
        return per_node * shard
    if s.engine.loading == "first":
        return whole
    return per_node * whole


def load_gpu_bytes(job: Job, s: Strategy) -> float:
    """Bytes on each GPU while the model loads, where that is above what training holds, else 0.

    Sharded QLoRA under ZeRO-3: transformers loads a quantized model without zero.Init, so every rank
    quantizes the whole model onto its GPU (one weight at a time moves there in the compute dtype and is
    quantized) before DeepSpeed partitions it (finetune/modeling/models.py, tests/test_qlora_sharded.py).
    """
    if not (job.method.spec.quantized_base and s.engine.deepspeed):
        return 0.0
    rt = runtime(job, s)
    largest = max(d_in * d_out for d_in, d_out in projection_shapes(job.model).values())
    return _base_bytes(job, rt) + rt.compute * largest + job.device.fixed_gb * GB


def _one_layer_params(c: ParamCounts) -> int:
    return c.per_layer


def _gathered_layer_bytes(job: Job, rt: Runtime) -> float:
    """One decoder layer as the sharded engine gathers it: in the compute dtype, or QLoRA's as stored (4-bit
    weights packed in the float storage dtype, norms in 16 bits; each projection is dequantized only while its
    matmul runs, the working set's term)."""
    c = job.counts
    if job.method.spec.quantized_base:
        return c.linear_per_layer * 4 / 8 + _kept_bytes(job) * c.other_per_layer
    return float(rt.compute * _one_layer_params(c))


def weights(job: Job, s: Strategy, rt: Runtime) -> tuple[float, float]:
    """(on each GPU, offloaded per GPU) bytes of the weights: sharded ones, what every rank holds whole (QLoRA's
    constants), and what the engine gathers."""
    divided, whole = _base_parts(job, rt)
    shards = _shards(job, s)
    if shards == 1:
        return divided + whole, 0.0
    on_gpu, host = (whole, divided / shards) if s.offload_params else (whole + divided / shards, 0.0)
    # the layer being computed and the next one (prefetch)
    on_gpu += 2 * _gathered_layer_bytes(job, rt)
    if rt.engine.holds_tail_gathered:
        # the tail unit (final norm and LM head; the embedding too when tied) stays gathered across the loss
        on_gpu += rt.compute * (job.counts.head + job.counts.final_norm)
    return on_gpu, host


def _layer(job: Job, rt: Runtime, checkpointing: bool) -> int:
    """Saved bytes of one decoder layer per token (the fitted formulas of `finetune.planner.activations`)."""
    return layer_bytes_per_token(LayerShape.of(job.model), layer_run(job, rt, checkpointing))


def layer_run(job: Job, rt: Runtime, checkpointing: bool) -> LayerRun:
    """How the trainer runs a decoder layer of this job (what the activation formulas need)."""
    method = job.method
    full = method.spec.trains_base_weights
    return LayerRun(
        method=method.name,
        dtype_bytes=rt.compute,
        autocast=rt.fp32_residual if full else rt.autocast,
        adapter_bytes=rt.adapter_compute if rt.engine.shards else rt.adapter_storage,
        lora_rank=method.lora_rank,
        lora_dropout=method.uses_adapters and method.lora_dropout > 0,
        checkpointing=checkpointing,
        device=rt.device,
        packed=rt.packed,
        expert_adapters=method.lora_experts,
    )


def _once_per_token(job: Job, rt: Runtime) -> int:
    """The final norm's saved bytes per token (both loss paths run the head themselves)."""
    return model_bytes_per_token(
        hidden=job.model.hidden_size,
        vocab=job.model.vocab_size,
        plain_loss=False,
        trainable_head=job.method.spec.trains_base_weights,
        head_in_model=False,
        autocast=rt.fp32_residual,
        dtype_bytes=rt.compute,
        fp32_norm_product=LayerShape.of(job.model).fp32_norm_product,
    )


def _adapter_copies(job: Job, rt: Runtime) -> int:
    """Autocast's bf16 copies of fp32 weights saved for backward, per decoder layer, and a mixture of experts'
    expert weights with their LoRA folded in (method.lora_experts)."""
    if job.method.spec.trains_base_weights:
        # a sparse layer's fp32 experts run grouped_mm in fp32: autocast copies attention and the router only
        copied = job.counts.linear_per_layer - expert_weights(LayerShape.of(job.model))
        return autocast_weight_copy_bytes(copied) if rt.fp32_residual else 0
    folded = folded_expert_bytes(LayerShape.of(job.model), layer_run(job, rt, checkpointing=False))
    fp32_adapters = rt.autocast and rt.adapter_storage == 4 and not rt.engine.shards
    copies = autocast_weight_copy_bytes(job.adapter // job.model.num_layers) if fp32_adapters else 0
    return copies + folded


def activations(job: Job, s: Strategy, rt: Runtime) -> float:
    """Activations saved for backward across the step (per GPU; sharding does not divide them).

    With checkpointing, each layer's input (and the packed rows' boolean mask, a checkpoint input shared by
    every layer); the layer being recomputed is transient and never coincides with the loss peak, so the
    overhead's working set counts it (`working_set`). Without, every layer's saved tensors, its packed-mask
    bias, and autocast's bf16 copies of fp32 weights.
    """
    m, tokens = job.model, rank_tokens(job, s)
    layers = m.num_layers - offloaded_layers(job, s)
    held = (_layer(job, rt, s.activation_checkpointing) * layers + _once_per_token(job, rt)) * tokens
    if s.activation_checkpointing:
        if rt.packed:
            held += micro_batch_rows(job, s) * job.seq_len**2  # the boolean mask, one byte a pair
        return held
    if rt.packed:
        held += m.num_layers * _mask_bias(job, s, rt)
    held += m.num_layers * split_saved_per_token(job, s, rt) * tokens
    return held + m.num_layers * _adapter_copies(job, rt)


# TRL's activation offloading (trl/models/activation_offloading.py) copies each saved tensor to pinned host
# memory as the forward makes it and back before its backward; the layer being copied and the one being
# brought back stay on the GPU.
OFFLOAD_LAYERS_ON_GPU = 2


def offloaded_layers(job: Job, s: Strategy) -> int:
    """Decoder layers whose checkpointed inputs activation offloading keeps in host memory."""
    if not (s.activation_offloading and s.activation_checkpointing):
        return 0
    return max(0, job.model.num_layers - OFFLOAD_LAYERS_ON_GPU)


def offloaded_activation_bytes(job: Job, s: Strategy, rt: Runtime) -> float:
    """Host bytes per GPU of the offloaded layer inputs (the PCIe traffic of a micro-batch, each way)."""
    return float(_layer(job, rt, True) * offloaded_layers(job, s) * rank_tokens(job, s))


def split_saved_per_token(job: Job, s: Strategy, rt: Runtime) -> int:
    """Bytes a decoder layer saves per local token beyond the unsplit layer's (`SequenceSplit.extra_saved_queries`)."""
    split = s.split
    if split is None:
        return 0
    return split.extra_saved_queries * rt.compute * job.model.num_heads * job.model.head_dim


def exchange_bytes(job: Job, s: Strategy, rt: Runtime) -> float:
    """The sequence split's transient buffers in one layer's attention: Ulysses' all-to-all inputs and outputs
    (queries, keys, values before attention, the output after), the ring's send and receive buffers of one
    peer's keys and values (`SequenceSplit.exchanged_per_token` gives the traffic)."""
    split = s.split
    if split is None:
        return 0.0
    m, tokens = job.model, rank_tokens(job, s)
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    width = 2 * (q + 2 * kv) if split.exchange == "all_to_all" else 2 * 2 * kv
    return float(rt.compute * tokens * width)


def _mask_bias(job: Job, s: Strategy, rt: Runtime) -> int:
    dtype = 2 if rt.fp32_residual else rt.compute  # the query's dtype: bf16 under autocast
    return attention_mask_bytes(tokens=job.seq_len, rows=micro_batch_rows(job, s), dtype_bytes=dtype)


def _head_dtype(job: Job, rt: Runtime) -> int:
    """Bytes of a value of the LM head's weight as the loss sees it."""
    if job.method.spec.trains_base_weights:
        return rt.compute if rt.engine.shards else rt.full_weights
    return rt.compute


def trl_tile_buffer(job: Job, rt: Runtime, tokens: int) -> float:
    """Bytes of TRL's tile buffer (`mm_buf` in trl/kernels/chunked_logprob.py), one in the forward and one in the
    backward: [min(tokens, 4096), 32768] in the compute dtype, whatever the vocabulary. A vocabulary narrower than
    32,768 writes only the first `vocab` values of each row, so on the CPU (a fresh mmap'd allocation) each row
    makes resident only the pages those values span: 4,096 rows of the tiny model's 512 fp32 logits hold 17 MB
    of the 537 MB allocated. CUDA's allocator counts every byte."""
    m, c = job.model, rt.compute
    rows = min(tokens, TRL_TILE_TOKENS)
    if not rt.resident or m.vocab_size >= TRL_TILE_VOCAB:
        return float(c * rows * TRL_TILE_VOCAB)
    return float(rows * math.ceil(c * m.vocab_size / CPU_PAGE_BYTES) * CPU_PAGE_BYTES)


def loss_peak(job: Job, s: Strategy, rt: Runtime) -> float:
    """Peak bytes of the loss (the contract's `logits` term), on top of the saved activations.

    Neither path builds the whole logits. The project's chunked loss (finetune/modeling/chunked_loss.py, inside
    the model's forward) makes every gradient in the forward: a [chunk, V] fp32 logits buffer (1.5x with a
    16-bit compute dtype: the chunk in bf16, its fp32 copy, then the fp32 gradient and its bf16 cast), the
    hidden-state gradient [N, h] kept until the backward, cast copies of the hidden states and the head where
    their dtype is not the compute dtype, and for a trainable head an fp32 accumulator [V, h] (cast to the
    head's dtype at the end). TRL's fused head (trl/kernels/chunked_logprob.py) keeps the hidden states
    [N, h] for its backward, which recomputes each [4096, 32768] tile in the compute dtype and accumulates
    fp32 gradients of the hidden states and of a trainable head, each then cast to its input's dtype; on the
    CPU torch ops fold each tile through fp32 copies (`trl_tile_fp32_copies`), on CUDA a Triton kernel folds
    it in place. ZeRO-3 gathers the head whole for either.
    """
    m = job.model
    h, vocab, tokens = m.hidden_size, m.vocab_size, rank_tokens(job, s)
    hidden = 4 if rt.fp32_residual or rt.compute == 4 else 2  # the backbone's output dtype
    head = _head_dtype(job, rt)
    c = rt.compute
    trainable = job.method.spec.trains_base_weights
    gathered = 2 * vocab * h if rt.engine.gathers_head_for_loss else 0
    if s.chunked_loss:
        rows = min(tokens, job.train.loss_chunk_size)
        chunk = (job.cal.chunked_loss_peak_factor if c == 2 else 1.0) * 4 * rows * vocab
        kept = hidden * tokens * h  # the hidden-state gradient, made in the forward
        casts = (c * tokens * h if hidden != c else 0) + (c * vocab * h if head != c else 0)
        rows_bytes = 2 * c * rows * h  # a chunk's rows of hidden states and of their gradient
        accumulator = 4 * vocab * h if trainable else 0
        if trainable and c == 2 and rt.device == "cpu":
            # no fp32-output matmul on the CPU: the chunk's logits gradient and rows are copied to fp32 to add
            # their product into the fp32 accumulator (chunked_loss._addmm_fp32)
            rows_bytes += 4 * rows * (vocab + h)
        during = chunk + casts + rows_bytes + accumulator
        after = accumulator + (head * vocab * h if trainable and head != 4 else 0)  # the head gradient's cast
        return gathered + kept + max(during, after)
    tile_tokens, tile_vocab = min(tokens, TRL_TILE_TOKENS), min(vocab, TRL_TILE_VOCAB)
    tile = tile_tokens * tile_vocab
    kept = hidden * tokens * h + 24 * tokens  # the hidden states, and fp32 per-token statistics and outputs
    cpu_tiles = 0.0
    if rt.device == "cpu":
        cpu_tiles = job.device.trl_tile_fp32_copies * 4 * tile
        if c == 2:  # no fp32-output matmul on the CPU: the head's chunk (and a trained head's rows) go fp32
            cpu_tiles += 4 * tile_vocab * h + (4 * tile_tokens * h if trainable else 0)
    tile_casts = (c * tile_tokens * h if hidden != c else 0) + (c * tile_vocab * h if head != c else 0)
    forward = trl_tile_buffer(job, rt, tokens) + tile_casts + cpu_tiles
    grads = 4 * tokens * h + (4 * vocab * h if trainable else 0)  # fp32 accumulators
    backward = grads + forward
    end = (
        grads
        + (hidden * tokens * h if hidden != 4 else 0)
        + (head * vocab * h if trainable and head != 4 else 0)
    )
    # The reference forward (DPO) runs between the policy's forward and the backward, with `kept` held.
    return gathered + kept + max(forward, backward, end, reference_forward_peak(job, s, rt))


def working_set(job: Job, s: Strategy, rt: Runtime) -> float:
    """Transient bytes of a layer's backward (fitted per device: `backward_working_set_layers`).

    The gradients of one layer's activations while its backward runs, as a fraction of what the layer saved
    (measured: scripts/bench_planner.py on the CPU, the GPU check on CUDA). With activation checkpointing,
    the layer being recomputed holds its full saved activations (and its packed-mask bias, and autocast's
    weight copies) meanwhile. QLoRA adds one projection dequantized to the compute dtype. Sharded full
    fine-tuning adds one layer's unsharded bf16 gradients before their reduce-scatter. None of these
    coincides with the loss peak (the loss is done before the first layer's backward), so the overhead term
    adds only the part above it.
    """
    tokens = rank_tokens(job, s)
    layer = float((_layer(job, rt, checkpointing=False) + split_saved_per_token(job, s, rt)) * tokens)
    layer += exchange_bytes(job, s, rt)
    if rt.packed:
        layer += _mask_bias(job, s, rt)
    working = job.device.backward_working_set_layers * (layer + _once_per_token(job, rt) * tokens)
    if s.activation_checkpointing:
        working += layer + _adapter_copies(job, rt)  # the layer being recomputed
    if job.method.spec.quantized_base:
        compute = 4 if job.method.quant_compute_dtype_on(job.hw.device) == "fp32" else 2
        working += compute * max(d_in * d_out for d_in, d_out in projection_shapes(job.model).values())
    if job.method.spec.trains_base_weights and rt.engine.shards:
        working += 2 * _one_layer_params(job.counts)
    # LoRA on experts: the gradient of one layer's folded expert weights, as large as they are
    working += folded_expert_bytes(LayerShape.of(job.model), layer_run(job, rt, checkpointing=False))
    return working


def step_gradients(job: Job, s: Strategy, rt: Runtime) -> float:
    """Bytes of the trainable parameters' gradients that each step allocates on the GPU and frees again.

    The trainer's `model.zero_grad()` sets gradients to None (torch's default), so one process, DDP and FSDP2
    allocate them afresh in every backward; ZeRO-3 writes them into a flat buffer allocated once (stage3.py's
    grad_partitions_flat_buffer), and offload keeps them on the host.
    """
    if rt.engine.deepspeed or s.offload_optimizer:
        return 0.0
    param = rt.full_weights if job.method.spec.trains_base_weights else rt.adapter_storage
    return param * job.trainable / _shards(job, s)


def fluctuating(job: Job, s: Strategy, rt: Runtime) -> float:
    """What each step allocates and frees (the activations, the loss, the working set above it, the
    gradients): what the allocator's reserved-but-unused share scales with (`allocator_fraction`), unlike the
    weights and states allocated once."""
    loss = loss_peak(job, s, rt)
    return _fluctuating(job, s, rt, activations(job, s, rt), loss, _above_loss(job, s, rt, loss))


def _above_loss(job: Job, s: Strategy, rt: Runtime, loss: float) -> float:
    """The backward working set's bytes above the loss peak (they never coincide)."""
    return max(0.0, working_set(job, s, rt) - loss)


def _fluctuating(job: Job, s: Strategy, rt: Runtime, acts: float, loss: float, above: float) -> float:
    return acts + loss + above + step_gradients(job, s, rt)


# glibc's ceiling on its dynamic mmap threshold on 64-bit (malloc.c's DEFAULT_MMAP_THRESHOLD_MAX, 4 MiB x
# sizeof(long)): a block this large or larger is always mapped apart and unmapped when freed, never kept in the heap
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20


def retained_heap(job: Job, s: Strategy, rt: Runtime) -> float:
    """Bytes of freed heap glibc keeps resident at a CPU step's peak (the process's RSS counts them).

    Each adapted projection's forward frees its d_out-wide outputs (the frozen layer's and the adapter's, summed
    into the result) between the small tensors the adapter saves for the backward (its r-wide input), so the
    holes they leave cannot be trimmed and stay resident. glibc's dynamic mmap threshold rises to the largest
    block freed, so outputs under 32 MiB come from that heap; larger ones are mapped apart and given back.
    `retained_adapter_outputs` of them per projection stay (calibration.json, fitted on whole CPU runs: BENCHMARKS.md,
    "The CPU plan's retained heap"). Full fine-tuning keeps no small tensors between its outputs: measured none.
    CUDA's caching allocator has its own share (`allocator_fraction`); its coefficient here is 0.
    """
    per_output = job.device.retained_adapter_outputs
    if not (per_output and rt.resident and job.method.uses_adapters):
        return 0.0
    tokens, shapes = rank_tokens(job, s), projection_shapes(job.model)
    outputs = [tokens * shapes[name][1] * rt.compute for name in job.method.targets(job.model.architecture)]
    return per_output * job.model.num_layers * sum(b for b in outputs if b < GLIBC_MMAP_THRESHOLD_MAX)


def memory(job: Job, s: Strategy, rt: Optional[Runtime] = None) -> tuple[Memory, float]:
    """Per-GPU memory terms (GB) and host memory offloaded per GPU (bytes)."""
    rt = rt or runtime(job, s)
    weights_gpu, weights_host = weights(job, s, rt)
    ref_gpu, ref_host = reference_weights(job, s, rt)
    weights_gpu, weights_host = weights_gpu + ref_gpu, weights_host + ref_host
    state_gpu, state_host = trainable_state(job, s, rt)
    acts = activations(job, s, rt)
    loss = loss_peak(job, s, rt)
    dev = job.device
    above = _above_loss(job, s, rt, loss)
    # the attention path's workspace, its own term: the mask biases above the loss peak, or flex's block mask
    mask_share = _mask_bias(job, s, rt) * (dev.backward_working_set_layers + s.activation_checkpointing)
    masks = workspace_above_loss(
        working_set=working_set(job, s, rt), mask_share=mask_share if rt.packed else 0.0, loss=loss
    )
    path = path_bytes(
        job.model, s, tokens=rank_tokens(job, s), rows=micro_batch_rows(job, s), dtype_bytes=rt.compute
    )
    overhead = (
        dev.fixed_gb * GB
        + above
        - masks
        + dev.allocator_fraction * _fluctuating(job, s, rt, acts, loss, above)
        + retained_heap(job, s, rt)
    )
    mem = Memory(
        weights=weights_gpu / GB,
        trainable_state=state_gpu / GB,
        activations=acts / GB,
        logits=loss / GB,
        attention=(masks + path) / GB,
        overhead=overhead / GB,
    )
    return mem, weights_host + state_host + offloaded_activation_bytes(job, s, rt)


def tensors_gb(job: Job, s: Strategy, rt: Optional[Runtime] = None) -> float:
    """What the allocator should see at the peak (max_memory_allocated): the four terms and the working set
    above the loss peak, without the fixed share and the allocator's."""
    rt = rt or runtime(job, s)
    mem, _ = memory(job, s, rt)
    above = max(0.0, working_set(job, s, rt) - mem.logits * GB)
    return mem.weights + mem.trainable_state + mem.activations + mem.logits + above / GB
