"""The memory terms a training step holds while it runs: saved activations (on the device, offloaded, exchanged
under a sequence split), the loss's peak (the project's chunked loss or TRL's fused LM head) and the reference
model's forward. finetune/planner/memory.py says what runs per engine."""

from __future__ import annotations

import math

from finetune.planner import companions
from finetune.planner.activations import (
    LayerRun,
    LayerShape,
    VisionShape,
    attention_mask_bytes,
    autocast_weight_copy_bytes,
    expert_weights,
    folded_expert_bytes,
    layer_bytes_per_token,
    model_bytes_per_token,
    vision_layer_bytes_per_patch,
    vision_tail_bytes_per_patch,
)
from finetune.planner.contract import Strategy
from finetune.planner.job import (
    CPU_PAGE_BYTES,
    TRL_TILE_TOKENS,
    TRL_TILE_VOCAB,
    Job,
    Runtime,
    micro_batch_rows,
    rank_tokens,
)
from finetune.planner.weights import one_layer_params, reference_copy


def reference_forward_peak(job: Job, s: Strategy, rt: Runtime) -> float:
    """The reference forward's transient peak (no saved activations: under no_grad each layer's tensors are
    freed as the next is made): one layer's forward tensors for the micro-batch, the hidden states in and
    out, and TRL's fused head's forward tile. It runs after the policy's forward, while the policy's
    activations are held, and is over before the backward starts."""
    if not job.reference_runs or s.precompute_reference:
        return 0.0
    tokens = micro_batch_rows(job, s) * job.seq_len
    m = job.model
    one_layer = layer_bytes(job, rt, checkpointing=False) * tokens
    hidden = 2 * rt.compute * tokens * m.hidden_size
    tile = trl_tile_buffer(job, rt, tokens) + 24 * tokens
    gathered = (
        2 * rt.compute * one_layer_params(job.counts) if reference_copy(job, s) and rt.engine.shards else 0
    )
    return one_layer + hidden + tile + gathered


def layer_bytes(job: Job, rt: Runtime, checkpointing: bool) -> int:
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
        attention=rt.attention,
    )


def once_per_token(job: Job, rt: Runtime) -> int:
    """The final norm's saved bytes per token (both loss paths run the head themselves); a score head runs inside
    the model and trains under every method, so it keeps its input (the normalized hidden state) too."""
    score_input = rt.compute * job.model.hidden_size if job.objective.head == "score" else 0
    return score_input + model_bytes_per_token(
        hidden=job.model.hidden_size,
        vocab=job.model.vocab_size,
        plain_loss=False,
        trainable_head=job.method.spec.trains_base_weights,
        head_in_model=False,
        autocast=rt.fp32_residual,
        dtype_bytes=rt.compute,
        fp32_norm_product=LayerShape.of(job.model).fp32_norm_product,
    )


def adapter_copies(job: Job, rt: Runtime) -> int:
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
    held = (layer_bytes(job, rt, s.activation_checkpointing) * layers + once_per_token(job, rt)) * tokens
    if s.activation_checkpointing:
        if rt.packed:
            held += micro_batch_rows(job, s) * job.seq_len**2  # the boolean mask, one byte a pair
        return held
    if rt.packed:
        held += m.num_layers * mask_bias(job, s, rt)
    held += m.num_layers * split_saved_per_token(job, s, rt) * tokens
    return held + m.num_layers * adapter_copies(job, rt)


def vision_activations(job: Job, s: Strategy, rt: Runtime) -> float:
    """What a vision-language model's encoder keeps for backward through the step (0 without an image side).

    One picture a row (`micro_batch_rows` pictures a micro-batch), each `image_crops x (image_size / patch_size)^2`
    patches through every encoder layer. A frozen tower (LoRA without `method.lora_vision`) runs without
    saving anything while nothing needs its gradient; with activation checkpointing the trainer makes every
    input embedding's output require grad (transformers' `enable_input_require_grads` hooks the vision
    embeddings too), so a gradient runs through the frozen encoder and each checkpointed layer keeps its
    input. Adapted (`method.lora_vision`) or trained whole, each layer keeps its saved tensors
    (`vision_layer_bytes_per_patch`), or its input when checkpointed. Then the final norm keeps its input
    and statistics, a trained projector its input, full fine-tuning the patch embedding's pixels and the
    positions' indices; adapted without checkpointing, the first layer's first norm keeps nothing (its input
    needs no gradient). The encoder's backward is the step's last, so all of it is held at the loss's peak.
    Measured to the byte on the CPU (scripts/measure_vision_activations.py); autocast's copies of the
    encoder's adapters are counted with the others (`adapter_copies`)."""
    m = job.model
    if not m.takes_images:
        return 0.0
    adapted = job.method.lora_vision
    trained = adapted or job.method.spec.trains_base_weights
    if not (trained or s.activation_checkpointing):
        return 0.0
    patches = micro_batch_rows(job, s) * m.image_crops * (m.image_size // m.patch_size) ** 2
    run = layer_run(job, rt, s.activation_checkpointing)
    shape = VisionShape.of(m)
    layer = vision_layer_bytes_per_patch(shape, run, adapted=adapted)
    # the patch embedding's input: three colours of a patch (Qwen2.5-VL's over two frames)
    pixels = 3 * m.patch_size**2 * (2 if shape.gated_mlp else 1)
    tail = vision_tail_bytes_per_patch(
        shape, run, patch_pixels=pixels, adapted=adapted, checkpointing=s.activation_checkpointing
    )
    return float(patches * (m.vision_layers * layer + tail))


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
    return float(layer_bytes(job, rt, True) * offloaded_layers(job, s) * rank_tokens(job, s))


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


def mask_bias(job: Job, s: Strategy, rt: Runtime) -> int:
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


# The whole logits' peak through TRL's ORPO and CPO loss (trl/experimental/orpo, cpo: the model's logits of both rows,
# the chosen rows' cross-entropy, `selective_log_softmax` of every row, then their backward), in fp32 copies of the
# logits [rows, T, V], by the compute dtype: measured on the CPU (tests/test_orpo_plan.py). Under bf16 autocast the
# cross-entropy and log-softmax run in fp32 beside the bf16 logits, hence more copies.
FULL_LOGITS_FP32_COPIES = {4: 4.2, 2: 6.55}


def full_logits_peak(job: Job, rt: Runtime, tokens: int) -> float:
    """Peak bytes of a loss on the model's whole logits (`ObjectiveSpec.full_logits`: ORPO, CPO, SimPO), on top
    of the saved activations: `FULL_LOGITS_FP32_COPIES` of the [tokens, V] logits in fp32, and a trainable
    head's input kept for its weight's gradient."""
    m = job.model
    head_input = rt.compute * tokens * m.hidden_size if job.method.spec.trains_base_weights else 0
    return FULL_LOGITS_FP32_COPIES[rt.compute] * 4 * tokens * m.vocab_size + head_input


def loss_dtype_bytes(rt: Runtime) -> int:
    """Bytes a value of a loss on whole logits: fp32 under autocast (its log-softmax runs in fp32), else the
    compute dtype's."""
    return 4 if rt.autocast else rt.compute


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
    if job.objective.head == "score":
        return score_loss_peak(job, s, rt)
    head = _head_dtype(job, rt)
    c = rt.compute
    trainable = job.method.spec.trains_base_weights
    gathered = 2 * vocab * h if rt.engine.gathers_head_for_loss else 0
    if job.objective.full_logits:
        return gathered + full_logits_peak(job, rt, tokens)
    comparison = companions.loss_peak(job.companions, loss_dtype_bytes(rt), tokens)
    if comparison:
        # the loss compares the whole logits with a companion's (distillation): both logits and the divergence's
        return gathered + comparison
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


def score_loss_peak(job: Job, s: Strategy, rt: Runtime) -> float:
    """The loss's peak with a score head (a reward model): no vocabulary logits. The head's one value a token
    [N, 1], the int64 positions transformers finds each row's last token with, and in the backward the gradient
    of the hidden states [N, h] the head hands the backbone (in the compute dtype, with its cast where the
    backbone's output is fp32)."""
    h, tokens, c = job.model.hidden_size, rank_tokens(job, s), rt.compute
    hidden = 4 if rt.fp32_residual or c == 4 else 2
    per_token = c + 2 * 8  # the scores, and the pad mask and position products as int64
    gradient = c * h + (hidden * h if hidden != c else 0)
    return float(tokens * (per_token + gradient))
