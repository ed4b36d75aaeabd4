"""The memory model: per-GPU bytes of a job under a strategy, term by term, as the trainer really runs it.

`Runtime` says what runs (the engine, the dtypes, autocast), derived from the
job and strategy by `runtime()` exactly as finetune/train sets the run up;
measurement scripts may describe what their own harness ran instead. `memory()`
returns the contract's terms (decimal GB) and the bytes offloaded to host RAM.

What runs, per engine (finetune/modeling/models.py; accelerate and DeepSpeed at the
versions of ARCHITECTURE.md, "Checked against"; MEMORY_MODEL.md has the tables). The terms live by kind:
job.py (what they are computed from), weights.py (held all run), step.py (held while a step runs); this
module adds them up.

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

from typing import Optional

from finetune.planner import companions
from finetune.planner.activations import (
    LayerShape,
    folded_expert_bytes,
)
from finetune.planner.attention import path_bytes, workspace_above_loss
from finetune.planner.contract import GB, Memory, Strategy
from finetune.planner.job import Job, Runtime, make_job, micro_batch_rows, rank_tokens, runtime, state_shards
from finetune.planner.params import projection_shapes
from finetune.planner.step import (
    activations,
    adapter_copies,
    exchange_bytes,
    layer_bytes,
    layer_run,
    loss_dtype_bytes,
    loss_peak,
    mask_bias,
    offloaded_activation_bytes,
    once_per_token,
    split_saved_per_token,
    vision_activations,
)
from finetune.planner.weights import (
    load_gpu_bytes,
    load_host_bytes,
    one_layer_params,
    reference_weights,
    trainable_state,
    weights,
)

# The memory model as the planner's search uses it: the job it is computed from, the totals, and what loading
# the model holds (the terms themselves live in job.py, weights.py and step.py, by kind).
__all__ = [
    "Job",
    "Runtime",
    "fluctuating",
    "load_gpu_bytes",
    "load_host_bytes",
    "make_job",
    "memory",
    "retained_heap",
    "runtime",
    "tensors_gb",
    "working_set",
]


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
    layer = float((layer_bytes(job, rt, checkpointing=False) + split_saved_per_token(job, s, rt)) * tokens)
    layer += exchange_bytes(job, s, rt)
    if rt.packed:
        layer += mask_bias(job, s, rt)
    working = job.device.backward_working_set_layers * (layer + once_per_token(job, rt) * tokens)
    if s.activation_checkpointing:
        working += layer + adapter_copies(job, rt)  # the layer being recomputed
    if job.method.spec.quantized_base:
        compute = 4 if job.method.quant_compute_dtype_on(job.hw.device) == "fp32" else 2
        working += compute * max(d_in * d_out for d_in, d_out in projection_shapes(job.model).values())
    if job.method.spec.trains_base_weights and rt.engine.shards:
        working += 2 * one_layer_params(job.counts)
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
    return param * job.trainable / state_shards(job, s)


def fluctuating(job: Job, s: Strategy, rt: Runtime) -> float:
    """What each step allocates and frees (the activations, the loss, the working set above it, the
    gradients): what the allocator's reserved-but-unused share scales with (`allocator_fraction`), unlike the
    weights and states allocated once."""
    loss = loss_peak(job, s, rt)
    acts = activations(job, s, rt) + vision_activations(job, s, rt)
    return _fluctuating(job, s, rt, acts, loss, _above_loss(job, s, rt, loss))


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
    vision = vision_activations(job, s, rt)
    loss = loss_peak(job, s, rt)
    dev = job.device
    above = _above_loss(job, s, rt, loss)
    # the attention path's workspace, its own term: the mask biases above the loss peak, or flex's block mask
    mask_share = mask_bias(job, s, rt) * (dev.backward_working_set_layers + s.activation_checkpointing)
    masks = workspace_above_loss(
        working_set=working_set(job, s, rt), mask_share=mask_share if rt.packed else 0.0, loss=loss
    )
    path = path_bytes(
        job.model, s, tokens=job.seq_len, rows=micro_batch_rows(job, s), run=layer_run(job, rt, False)
    )
    overhead = (
        dev.fixed_gb * GB
        + job.library_imports
        + above
        - masks
        + dev.allocator_fraction * _fluctuating(job, s, rt, acts + vision, loss, above)
        + retained_heap(job, s, rt)
    )
    rows = micro_batch_rows(job, s)
    companion_terms = companions.terms(
        job.companions, s, rt.compute, rows, rank_tokens(job, s) // rows, rt.packed, state_shards(job, s),
        loss_dtype_bytes(rt),
    )  # fmt: skip
    mem = Memory(
        weights=weights_gpu / GB,
        trainable_state=state_gpu / GB,
        activations=acts / GB,
        logits=loss / GB,
        attention=(masks + path) / GB,
        overhead=overhead / GB,
        vision_activations=vision / GB,
        companions=tuple((name, held / GB) for name, held in companion_terms),
    )
    companions_host = companions.host_bytes(job.companions, s, rt.compute, state_shards(job, s))
    return mem, weights_host + state_host + offloaded_activation_bytes(job, s, rt) + companions_host


def tensors_gb(job: Job, s: Strategy, rt: Optional[Runtime] = None) -> float:
    """What the allocator should see at the peak (max_memory_allocated): the four terms and the working set
    above the loss peak, without the fixed share and the allocator's."""
    rt = rt or runtime(job, s)
    mem, _ = memory(job, s, rt)
    above = max(0.0, working_set(job, s, rt) - mem.logits * GB)
    held = (
        mem.weights + mem.trainable_state + mem.activations + mem.vision_activations + mem.logits + above / GB
    )
    return held + sum(gb for _, gb in mem.companions)
