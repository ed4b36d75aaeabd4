"""The memory terms a rank holds for the whole run: the weights (the base or stored weights, gathered layers,
the reference model's), the trainable state (gradients, master copies, optimizer moments), and what loading
the model holds on the host and the device. finetune/planner/memory.py says what runs per engine."""

from __future__ import annotations

from typing import Optional

from finetune.planner.contract import GB, Strategy
from finetune.planner.job import ZERO3_SUB_GROUP, Job, Runtime, quant_constant_bits, runtime, state_shards
from finetune.planner.params import ParamCounts, projection_shapes


def reference_copy(job: Job, s: Strategy) -> bool:
    """Full fine-tuning with a reference holds a frozen copy of the starting model: a per-step one (DPO, KTO)
    unless its log-probabilities are precomputed, and a `when_kl` one (GRPO, RLOO with beta > 0: TRL's
    trainers build it as DPO's) whenever it runs; adapters use the base with the adapter disabled."""
    if not job.method.spec.trains_base_weights:
        return False
    return job.kl_reference or (job.reference_runs and not s.precompute_reference)


def reference_weights(job: Job, s: Strategy, rt: Runtime) -> tuple[float, float]:
    """(on each GPU, offloaded per GPU) bytes of the frozen reference copy: in the policy's parameter dtype (TRL
    builds it with `dtype=model.dtype`), sharded like the policy under ZeRO-3 and FSDP2 (`prepare_deepspeed` /
    `prepare_fsdp` take the engine's settings, parameter offload included)."""
    if not reference_copy(job, s):
        return 0.0, 0.0
    per = rt.compute if rt.engine.shards else rt.full_weights
    held = per * job.counts.total / state_shards(job, s)
    return (0.0, held) if s.offload_params else (held, 0.0)


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
    n, shards = job.trainable, state_shards(job, s)
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
    return _base_bytes(job, rt) + rt.compute * largest + job.device.fixed_gb * GB + job.library_imports


def one_layer_params(c: ParamCounts) -> int:
    return c.per_layer


def _gathered_layer_bytes(job: Job, rt: Runtime) -> float:
    """One decoder layer as the sharded engine gathers it: in the compute dtype, or QLoRA's as stored (4-bit
    weights packed in the float storage dtype, norms in 16 bits; each projection is dequantized only while its
    matmul runs, the working set's term)."""
    c = job.counts
    if job.method.spec.quantized_base:
        return c.linear_per_layer * 4 / 8 + _kept_bytes(job) * c.other_per_layer
    return float(rt.compute * one_layer_params(c))


def weights(job: Job, s: Strategy, rt: Runtime) -> tuple[float, float]:
    """(on each GPU, offloaded per GPU) bytes of the weights: sharded ones, what every rank holds whole (QLoRA's
    constants), and what the engine gathers."""
    divided, whole = _base_parts(job, rt)
    shards = state_shards(job, s)
    if shards == 1:
        return divided + whole, 0.0
    on_gpu, host = (whole, divided / shards) if s.offload_params else (whole + divided / shards, 0.0)
    # the layer being computed and the next one (prefetch)
    on_gpu += 2 * _gathered_layer_bytes(job, rt)
    if rt.engine.holds_tail_gathered:
        # the tail unit (final norm and LM head; the embedding too when tied) stays gathered across the loss
        on_gpu += rt.compute * (job.counts.head + job.counts.final_norm)
    return on_gpu, host


def generation_gathered(job: Job, s: Strategy, rt: Runtime, companion_bytes: Optional[float] = None) -> float:
    """Bytes each rank holds beyond its terms while TRL generates inside the trainer under an engine that gathers
    the whole model for it (ZeRO-3's GatheredParameters): the policy's base and trainable parameters beyond its
    weights term, or a frozen companion's `companion_bytes` (its weights whole) beyond the share its own term
    holds. 0 for an engine that gathers a layer at a time, or one that does not shard."""
    shards = state_shards(job, s)
    if not rt.engine.gathers_whole_to_generate or shards == 1:
        return 0.0
    if companion_bytes is not None:
        return companion_bytes * (1 - 1 / shards)
    divided, whole = _base_parts(job, rt)
    trainable = 0.0 if job.method.spec.trains_base_weights else job.adapter * rt.adapter_storage
    on_gpu, _ = weights(job, s, rt)
    return max(0.0, divided + whole + trainable * (1 - 1 / shards) - on_gpu)
