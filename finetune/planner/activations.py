"""Activation memory: bytes a Llama-style decoder saves for backward, per token (pure: stdlib only).

Where the coefficients come from: scripts/measure_activations.py counts, under
`torch.autograd.graph.saved_tensors_hooks`, the distinct storages autograd keeps
(parameters and the shared rotary cos/sin excluded) for transformers'
LlamaDecoderLayer / Qwen2DecoderLayer, batch 1, SDPA, on CPU (torch,
transformers, peft and bitsandbytes at the versions of ARCHITECTURE.md,
"Checked against"; activations.json's meta records the torch and transformers
that ran), over 11 layer shapes from hidden 256 to 8192; the measurements are
in activations.json next to this file (MEMORY_MODEL.md, Activations, has the
reference table). Every term below is an integer count of saved tensors and
reproduces every measurement to the byte (tests/test_activations.py checks
it). Rerun the script after upgrading torch, transformers or peft.

Symbols: h hidden, I intermediate, H heads, KV kv heads, d head dim, r LoRA rank,
c the compute dtype's bytes (2 bf16, 4 fp32). Per layer, without checkpointing:

    full FT, bf16                16h +  8I + 4Hd + 4KVd + 4H + 8
    full FT, fp32 under autocast 26h +  8I + 4Hd + 4KVd + 4H + 8   (the trainer on one GPU / DDP)
    full FT, fp32                24h + 16I + 8Hd + 8KVd + 4H + 8
    LoRA, bf16 adapters          12h +  8I + 4Hd + 4KVd + 4H + 8 + 14r
    LoRA, fp32 adapters          28h + 10I + 8Hd + 4KVd + 4H + 8 + 28r   (PEFT's upcast, no autocast)
    LoRA, fp32 adapters, autocast 18h + 8I + 6Hd + 4KVd + 4H + 8 + 14r   (the trainer's bf16 LoRA)
    LoRA, fp32 base and adapters 16h + 16I + 8Hd + 8KVd + 4H + 8 + 28r

LoRA dropout > 0 replaces the shared adapter inputs by, per adapted input (q, k,
v, gate, up: h; o: H*d; down: I), the dropout's output (the adapter's bytes, or
bf16 under autocast) and its mask: an a-byte noise tensor on the CPU, a 1-byte
bool mask on CUDA (`device`). QLoRA measures the same as LoRA (the NF4 base
keeps nothing per token).

Packed rows (the collator's position_ids restart per sample; transformers then
builds a block-diagonal mask for SDPA): repeat_kv copies k and v to every head,
2c(Hd - KVd) more per token, and SDPA converts the boolean mask to an additive
c-byte [T, T] bias per row that each layer saves (`attention_mask_bytes`): 134 MB a
layer at 8,192 tokens. Measured on the CPU; CUDA's memory-efficient kernel takes
the same bias (the flash kernel takes no mask).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from finetune.core.architectures import ARCHITECTURES
from finetune.core.methods import METHODS

DEVICES = ("cpu", "cuda")
ATTENTION_PATHS = ("sdpa", "eager", "flex", "flash")


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's shape: what its saved bytes depend on."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    # Qwen2's q/k/v biases (measured: the bias add keeps no tensor; kept for the measurements' record).
    attention_bias: bool = False
    # Gemma's RMSNorm multiplies by (1 + weight) in fp32: a trainable norm keeps its normalized input in fp32.
    fp32_norm_product: bool = False
    # Qwen3's and Gemma 3's RMSNorm of each head's query and key (q_norm, k_norm) before rotary.
    qk_norm: bool = False
    # Gemma 3's post-attention and post-feedforward norms: four norms a layer instead of two.
    sandwich_norms: bool = False
    # Phi-3/4's fused qkv_proj and gate_up_proj (four linear modules a layer instead of seven).
    fused_projections: bool = False
    # A mixture of experts' sparse layer (Qwen3-MoE): `experts` fused experts of width `intermediate`, of
    # which `experts_per_token` run per token (0: a dense MLP).
    experts: int = 0
    experts_per_token: int = 0
    # the router's top-k weights divided by their sum (`norm_topk_prob`), and kept fp32 (Mixtral)
    renormalized_routing: bool = False
    fp32_routing_weights: bool = False
    # gpt-oss: the router's softmax over its top-k logits only, and the clamped SwiGLU of its experts
    softmax_after_topk: bool = False
    clamped_swiglu: bool = False
    # each expert's biases (gpt-oss): trained, their gather by expert keeps the sorted expert ids
    expert_biases: bool = False

    @classmethod
    def of(cls, model: Any) -> LayerShape:
        """The shape of a `ModelConfig`'s decoder layer."""
        arch = ARCHITECTURES[model.architecture]
        return cls(
            hidden=model.hidden_size,
            intermediate=model.expert_intermediate_size if model.num_experts else model.intermediate_size,
            heads=model.num_heads,
            kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            attention_bias=model.attention_bias,
            fp32_norm_product=arch.fp32_norm_product,
            qk_norm=arch.qk_norm,
            sandwich_norms=arch.sandwich_norms,
            fused_projections=arch.fused_projections,
            experts=model.num_experts,
            experts_per_token=model.num_experts_per_token,
            renormalized_routing=model.norm_topk_prob or arch.fp32_routing_weights,
            fp32_routing_weights=arch.fp32_routing_weights,
            softmax_after_topk=arch.softmax_after_topk,
            clamped_swiglu=arch.clamped_swiglu,
            expert_biases=arch.expert_biases,
        )


@dataclass(frozen=True)
class LayerRun:
    """How a layer runs, as far as its saved bytes care (the planner derives it from the job and strategy;
    the measurement scripts describe their own harness)."""

    # a `finetune.core.methods` entry: one that trains the base weights follows full fine-tuning's formulas
    method: str
    # the compute dtype's bytes: 2 (bf16 weights) or 4 (everything fp32)
    dtype_bytes: int = 2
    # accelerate's bf16 autocast around the forward
    autocast: bool = False
    # the adapters' dtype as they multiply: 2 (bf16) or 4 (fp32, PEFT's default upcast)
    adapter_bytes: int = 2
    lora_rank: int = 16
    lora_dropout: bool = False
    checkpointing: bool = False
    # cpu | cuda: dropout masks differ
    device: str = "cpu"
    # rows carry position_ids (packed samples): transformers builds a block-diagonal mask for SDPA
    packed: bool = False
    # LoRA on a mixture of experts' fused expert weights too (PEFT's target_parameters), not attention only
    expert_adapters: bool = False
    # the attention implementation (`planner/attention.py`): eager attention keeps copies of k and v for every
    # head and its softmax's [T, T + 1] (`eager_scores_bytes`); FlexAttention and flash-attn are modelled as SDPA
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {tuple(METHODS)}, got {self.method!r}")
        if self.adapter_bytes not in (2, 4):
            raise ValueError(f"adapter_bytes must be 2 (bf16) or 4 (fp32), got {self.adapter_bytes!r}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes must be 2 (bf16) or 4 (fp32), got {self.dtype_bytes!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {self.attention!r}")
        if self.autocast and self.dtype_bytes == 4 and not METHODS[self.method].trains_base_weights:
            raise ValueError("autocast: bf16 autocast runs on a bf16 base (dtype_bytes=2) for LoRA")

    @property
    def fp32_weights(self) -> bool:
        """The weights are fp32: full fine-tuning's master weights under autocast, or everything fp32."""
        return self.dtype_bytes == 4 or (self.autocast and METHODS[self.method].trains_base_weights)


def layer_bytes_per_token(shape: LayerShape, run: LayerRun) -> int:
    """Bytes one decoder layer keeps for backward per token (SDPA, batch rows of one sequence each).

    An adapter method follows LoRA's formulas (on all seven projections; QLoRA measures the same). Under
    `autocast`: for full fine-tuning, fp32 weights under it (the residual stream is then fp32:
    10 x hidden more a layer, and autocast's bf16 copy of every weight is saved too, a constant per
    layer: `autocast_weight_copy_bytes`); for LoRA on a bf16 base, PEFT's fp32 cast of each adapter
    input is cast back to bf16 (fp32 adapters keep 2 bytes a value instead of 4; bf16 adapters are
    unchanged, measured). With `checkpointing` this is what each checkpointed layer keeps, its input
    (2 x hidden, 4 x hidden when the residual stream is fp32); the planner adds ONE layer's
    non-checkpointed figure for the layer being recomputed during backward. `attention_bias` (Qwen2's
    q/k/v biases) changes nothing: measured, the bias add keeps no tensor. `fp32_norm_product`: Gemma's
    RMSNorm multiplies by (1 + weight) in fp32, so a trainable norm keeps its normalized input in fp32
    (2 x hidden more a norm; measured, as is everything else of Gemma's layer equal to Llama's).
    """
    if shape.experts:
        return _sparse_layer_bytes(shape, run)
    hidden, intermediate, heads = shape.hidden, shape.intermediate, shape.heads
    full = METHODS[run.method].trains_base_weights
    autocast, lora_rank, lora_dropout, device = run.autocast, run.lora_rank, run.lora_dropout, run.device
    h, inter, q_dim, kv_dim = hidden, intermediate, heads * shape.head_dim, shape.kv_heads * shape.head_dim
    c = run.dtype_bytes
    fp32_residual = c == 4 or (autocast and full)
    if run.checkpointing:
        return (4 if fp32_residual else 2) * h  # the layer input, saved by torch.utils.checkpoint
    # attention: q and k after rotary, v, SDPA's output and its fp32 logsumexp per head; o_proj's input is
    # a view of SDPA's output. Packed rows: repeat_kv's copies of k and v for every head.
    attention = c * (2 * q_dim + 2 * kv_dim) + 4 * heads
    eager = run.attention == "eager"
    if run.packed or eager:
        attention += 2 * c * (q_dim - kv_dim)
    elif shape.fused_projections:
        attention += c * (q_dim + kv_dim)  # v is a view of qkv_proj's output: SDPA keeps all of its storage
    if eager:  # the softmax's max, taken for stability: int64 indices per head where SDPA keeps an fp32 lse
        attention += 4 * heads
        # its output feeds o_proj only: kept by o_proj's weight gradient or an adapter sharing the base input,
        # not where each adapter casts its own input (or drops it out)
        if not full and (lora_dropout or run.adapter_bytes != c):
            attention -= c * q_dim
    # each RMSNorm: its fp32 upcast of the input (the input itself when it is fp32), and the fp32 rsqrt
    norms = (4 if shape.sandwich_norms else 2) * (4 * h + 4)
    if shape.qk_norm:  # the same for each head's query and key (rsqrt per head)
        norms += 4 * (q_dim + kv_dim) + 4 * (heads + shape.kv_heads)
    # gate, up and silu(gate) outputs (Phi's gate and up are views of gate_up_proj's output: the same bytes)
    mlp = 3 * c * inter
    # Phi's o_proj input is a copy of SDPA's output, kept where the base linear or a same-dtype adapter keeps it
    o_copy = c * q_dim if shape.fused_projections else 0
    if full:
        # each RMSNorm also keeps its normalized input to the weight product (for the norm weight's grad)
        # and its output (for the projections' weight grads); down_proj keeps act*up. Under autocast the
        # residual stream is fp32: the norms' inputs and normalized outputs are fp32 and each projection
        # saves its own bf16 cast of its input (measured: exactly 10 x hidden more than bf16).
        wider = 4 * h if shape.fp32_norm_product and not fp32_residual else 0
        # Gemma 3's post-norms keep only their normalized input (their output goes to the residual add)
        post = 2 * (4 if shape.fp32_norm_product or fp32_residual else c) * h if shape.sandwich_norms else 0
        # q/k norms keep their normalized input too: fp32 for Gemma's product, else in q's and k's dtype (the
        # projections' outputs: bf16 under autocast)
        qk = (4 if shape.fp32_norm_product else c) * (q_dim + kv_dim) if shape.qk_norm else 0
        # under autocast each projection reading the residual stream keeps its own bf16 copy of it (5; Phi's 2)
        casts = 2 * (2 if shape.fused_projections else 5) * h if autocast else 0
        return norms + 2 * c * (2 * h) + attention + mlp + c * inter + casts + wider + post + qk + o_copy
    a = run.adapter_bytes
    # the inputs of the adapters (q, k, v, gate, up share h; Phi's qkv and gate_up each take h once)
    adapted = (2 * h if shape.fused_projections else 5 * h) + q_dim + inter
    adapters = 4 if shape.fused_projections else 7
    kept = 2 if autocast and a == 4 else a  # what each adapter's lora_A keeps of its input
    lora_a_outputs = adapters * lora_rank * kept  # kept by each lora_B
    if lora_dropout:
        # the dropout's output (kept by lora_A) and its mask: CUDA's fused dropout keeps a bool, the CPU's a
        # noise tensor in the dtype it ran in (fp32 under autocast: it drops out PEFT's fp32 copy)
        mask = 1 if device == "cuda" else a
        adapter_inputs = (kept + mask) * adapted
    elif a != c:
        # PEFT casts each adapter's input to the adapter dtype separately (under autocast, and cast back)
        adapter_inputs = kept * adapted
    else:
        # same-dtype adapters keep the base layers' own inputs: the two norm outputs and act*up (o's is SDPA's)
        adapter_inputs = c * (2 * h + inter) + o_copy
    return norms + attention + mlp + adapter_inputs + lora_a_outputs


def _sparse_layer_bytes(shape: LayerShape, run: LayerRun) -> int:
    """A Qwen3-MoE or Mixtral sparse layer (LoRA without dropout, or full): its attention, and the routed MLP per
    token.

    Measured (scripts/measure_activations.py, MOE_SHAPES; transformers' grouped_mm experts, the path its
    models take): each of the k routed copies of a token keeps its permuted input (h), the gate_up output
    (2I) and act(gate) (I) in the compute dtype, and its routing weight; the router keeps its fp32 softmax
    (4E) and 32 bytes per routed copy of indices (int64 top-k, sort and inverse permutation). Mixtral's
    experts are the same code (its routing weights stay fp32: `fp32_routing_weights`). LoRA on the
    experts (`expert_adapters`) folds B @ A into the expert weights, which then need grads: grouped_mm also
    keeps each copy's input to down_proj (I) and the permuted input once more (h); the folded weights
    themselves are a per-layer constant (`folded_expert_bytes`). Attention's adapters are as Qwen3's (their
    dropout as measured there; the experts take none). Full fine-tuning keeps what expert LoRA keeps (the expert
    weights need grads either way) on top of the dense full formula at I = 0; under autocast its fp32 experts
    run grouped_mm in fp32 (not an autocast op): the routed copies are fp32, and the router is the fourth
    bf16 copy of the residual stream where the dense layer had gate and up (2h less).
    """
    dense = replace(shape, intermediate=0, experts=0, experts_per_token=0)
    attention_only = layer_bytes_per_token(dense, run)  # with the MLP's adapter terms at I = 0, removed next
    if run.checkpointing:
        return attention_only
    h, c, k, a = shape.hidden, run.dtype_bytes, shape.experts_per_token, run.adapter_bytes
    i = shape.intermediate
    if METHODS[run.method].trains_base_weights:
        routed_c = 4 if run.autocast else c
        router_c = (
            2 if run.autocast else c
        )  # the router's logits (and so Qwen's top-k weights) under autocast
        casts = 2 * h if run.autocast else 0
        routed = k * routed_c * (2 * h + 4 * i) + _routing_bytes(shape, router_c)
        if shape.clamped_swiglu:
            routed += k * routed_c * 3 * i
        if shape.expert_biases:  # the biases' gather by the sorted expert ids keeps those (int64)
            routed += 8 * k
        return attention_only - casts + routed
    kept = 2 if run.autocast and a == 4 else a
    # the dense formula at I = 0 still adapts gate and up on the second norm's output (its branches: dropout's
    # output and mask, a cast to the adapter dtype, or the shared input); LoRA here adapts attention only
    if run.lora_dropout:
        gate_up = (kept + (1 if run.device == "cuda" else a)) * 2 * h
    elif a != c:
        gate_up = kept * 2 * h
    else:
        gate_up = c * h
    attention_only -= gate_up + 3 * run.lora_rank * kept
    routed = k * c * (h + 3 * i) + _routing_bytes(shape, c)
    if shape.clamped_swiglu:  # the clamped gate and up, sigmoid(1.702 gate) and up + 1, where SiLU kept one
        routed += k * c * 3 * i
    if run.expert_adapters:
        routed += k * c * (h + i)
    return attention_only + routed


def _routing_bytes(shape: LayerShape, c: int) -> int:
    """The router's per-token bytes: its fp32 softmax (4E), 32 bytes of indices a routed copy, and the top-k
    weights: in the logits' dtype `c` (Qwen3-MoE), with the fp32 sum and quotient when renormalized; Mixtral's
    stay fp32 and renormalized (measured, bf16 and fp32 alike: 8k + 4)."""
    k = shape.experts_per_token
    if shape.fp32_routing_weights:
        weights = 8 * k + 4
    else:
        weights = k * c + (4 * k + 4 if shape.renormalized_routing else 0)
    if shape.softmax_after_topk:  # gpt-oss: the softmax over the k logits, kept in their dtype; no E-wide one
        return weights + k * c + 32 * k
    return weights + 4 * shape.experts + 32 * k


def expert_weights(shape: LayerShape) -> int:
    """One sparse layer's expert weights (E x 3hI: gate_up and down), which autocast does not copy (measured)."""
    return shape.experts * 3 * shape.hidden * shape.intermediate


def folded_expert_bytes(shape: LayerShape, run: LayerRun) -> int:
    """PEFT's expert weights with LoRA folded in (W + B @ A, `torch.baddbmm`), one sparse layer's, saved for
    backward in the compute dtype whatever the token count (measured); their gradient is as large."""
    if not (shape.experts and run.expert_adapters):
        return 0
    return run.dtype_bytes * expert_weights(shape)


def attention_mask_bytes(*, tokens: int, rows: int, dtype_bytes: int = 2) -> int:
    """The additive [T, T] bias SDPA makes from a packed row's boolean mask, per layer (each layer saves its own).

    Per micro-batch of `rows` rows of `tokens` tokens, in the compute dtype (bf16 under autocast too:
    the query is bf16). Measured to the byte on the CPU (scripts/measure_activations.py, packed cases).
    """
    return rows * tokens * tokens * dtype_bytes


def eager_scores_bytes(*, heads: int, tokens: int, rows: int, run: LayerRun, sinks: bool = True) -> int:
    """Eager attention's softmax output, saved for backward, per layer: heads x T x (T + 1) a row (the sink's
    column; T without sinks), in the logits' dtype promoted with the sinks': fp32 where the weights are fp32
    (full fine-tuning under autocast, or everything fp32), else the compute dtype. Where that is wider than the
    values (autocast), the product with the values keeps a [T, T] copy in their dtype too. Measured to the byte
    on gpt-oss's layer on the CPU (scripts/measure_activations.py --moe)."""
    scores = 4 if run.fp32_weights else run.dtype_bytes
    held = rows * heads * tokens * (tokens + int(sinks)) * scores
    if scores != run.dtype_bytes:
        held += rows * heads * tokens * tokens * run.dtype_bytes
    return held


def model_bytes_per_token(
    *,
    hidden: int,
    vocab: int,
    plain_loss: bool = True,
    trainable_head: bool = True,
    head_in_model: bool = True,
    autocast: bool = False,
    dtype_bytes: int = 2,
    fp32_norm_product: bool = False,
) -> int:
    """Bytes kept once per model per token: final RMSNorm, and (when the model runs it) the LM head's input.

    Measured with transformers' ForCausalLMLoss (fp32 upcast of the logits): the fp32 log-softmax
    (4 x vocab) and the int64 labels (8): `plain_loss`. The trainer takes neither: both its loss paths
    (the project's chunked loss and TRL's fused head) run the head themselves on the backbone's last
    hidden state (`head_in_model=False`), and the planner counts what they keep in its loss term. A
    frozen norm and head (LoRA, QLoRA: `trainable_head=False`) keep neither the normalized input nor the
    head's input. Under `autocast` (full
    fine-tuning with fp32 weights) or with fp32 weights (`dtype_bytes=4`) the normalized input is fp32.
    """
    h = hidden
    wide = 4 if autocast or dtype_bytes == 4 or fp32_norm_product else 2
    kept = 4 * h + 4  # the norm's fp32 upcast (or fp32 input) and rsqrt
    if trainable_head:
        kept += wide * h  # normalized input of the norm weight
        if head_in_model:
            kept += (2 if autocast else dtype_bytes) * h  # lm_head's input, for its weight's gradient
    if plain_loss:
        kept += 4 * vocab + 8
    return kept


def autocast_weight_copy_bytes(linear_params: int) -> int:
    """Autocast's bf16 copies of fp32 weights, saved for backward: 2 bytes a weight of every linear that ran.

    Measured per layer whatever the token count (full fine-tuning's fp32 weights; LoRA's fp32 adapters);
    with checkpointing only the layer being recomputed holds its copies.
    """
    return 2 * linear_params


@dataclass(frozen=True)
class VisionShape:
    """A vision encoder layer's shape (`model.vision_*`): what its saved bytes per patch depend on."""

    hidden: int
    intermediate: int
    heads: int
    # Qwen2.5-VL's gated MLP (gate, up, act(gate): three intermediate-wide tensors) instead of fc1 / GELU / fc2
    gated_mlp: bool = False

    @classmethod
    def of(cls, model: Any) -> VisionShape:
        tower = ARCHITECTURES[model.architecture].vision
        return cls(
            hidden=model.vision_hidden_size,
            intermediate=model.vision_intermediate_size,
            heads=model.vision_heads,
            gated_mlp=tower is not None and tower.gated_mlp,
        )


def norm_stats_bytes(run: LayerRun) -> int:
    """A LayerNorm's saved mean and rstd per row: fp32 on CUDA, the input's dtype on the CPU (measured)."""
    return 8 if run.device == "cuda" else 2 * run.dtype_bytes


def vision_layer_bytes_per_patch(shape: VisionShape, run: LayerRun, *, adapted: bool) -> int:
    """Bytes one vision encoder layer keeps for backward per patch, when a gradient runs through it.

    Measured on Idefics3's SigLIP layer (scripts/measure_vision_activations.py, to the byte): two LayerNorms
    each keep their input and its mean and rstd (`norm_stats_bytes`); SDPA keeps q, k, v, its output (out_proj's
    input is the same storage) and an fp32 logsumexp per head (no mask: every patch of a resized picture is
    real); GELU keeps fc1's output. `adapted` (`method.lora_vision`): LoRA on its six linear layers, whose
    adapters keep their inputs (the LayerNorms' outputs and GELU's, shared in the adapters' dtype; else each
    adapter's own cast copy: q, k, v and fc1 on the norms' outputs, out_proj on SDPA's, fc2 on GELU's) and
    their lora_A outputs. Full fine-tuning keeps the same inputs for the weights' gradients, without the
    adapters. Frozen (a gradient runs through only because the trainer makes the inputs require grad), the base
    linear layers keep nothing but their weights. With `run.checkpointing`, the layer's input alone. Qwen2.5-VL's
    block: `_gated_layer_bytes`."""
    d, f, c = shape.hidden, shape.intermediate, run.dtype_bytes
    if run.checkpointing:
        return c * d
    if shape.gated_mlp:
        return _gated_layer_bytes(shape, run, adapted=adapted)
    kept = 2 * (c * d + norm_stats_bytes(run)) + 4 * c * d + 4 * shape.heads + c * f
    full = METHODS[run.method].trains_base_weights
    if not (adapted or full):
        return kept
    a = run.adapter_bytes
    held = 2 if run.autocast and a == 4 else a  # what each lora_A keeps of its input (bf16 under autocast)
    # shared: the norms' outputs and GELU's, the q/k/v, fc1 and fc2 inputs; else each adapter's own cast copy
    inputs = c * (2 * d + f) if full or a == c else held * (5 * d + f)
    lora_a_outputs = 0 if full else 6 * run.lora_rank * held
    return kept + inputs + lora_a_outputs


def _gated_layer_bytes(shape: VisionShape, run: LayerRun, *, adapted: bool) -> int:
    """Qwen2.5-VL's vision block per patch: two RMSNorms (each its fp32 input and rsqrt; under full fine-tuning
    also its normalized input and output), the fused qkv's output (SDPA keeps v as a view of it), q and k after
    rotary, SDPA's output per window and fp32 logsumexp per head, the windows' outputs joined (proj's input),
    and the gated MLP's gate, up and act(gate) (and act(gate) x up, down's input). Measured to the byte for full
    fine-tuning in fp32 on a 2-block tower (transformers' Qwen2_5_VisionTransformerPretrainedModel, SDPA, on the
    CPU); LoRA follows the same inputs as Idefics3's layer (qkv, proj, gate, up, down), not measured."""
    d, f, c = shape.hidden, shape.intermediate, run.dtype_bytes
    norms = 2 * (4 * d + 4)
    attention = 3 * c * d + 2 * c * d + c * d + 4 * shape.heads
    mlp = 3 * c * f
    kept = norms + attention + mlp
    full = METHODS[run.method].trains_base_weights
    if full:
        # the norms' normalized inputs and outputs, proj's input, down's input
        return kept + 2 * 2 * c * d + c * d + c * f
    if not adapted:
        return kept
    a = run.adapter_bytes
    held = 2 if run.autocast and a == 4 else a
    inputs = c * (2 * d + d + f) if a == c else held * (4 * d + f)
    return kept + inputs + 5 * run.lora_rank * held


def vision_tail_bytes_per_patch(
    shape: VisionShape, run: LayerRun, *, patch_pixels: int, adapted: bool, checkpointing: bool
) -> int:
    """What the encoder keeps per patch besides its layers, when a gradient runs through it: the final norm
    (Idefics3's post-LayerNorm, Qwen2.5-VL's merger RMSNorm) and a trained projector's inputs; under full
    fine-tuning the patch embedding's input (`patch_pixels` values a patch) and Idefics3's int64 positions.
    Adapted without checkpointing, Idefics3's first layer's first norm keeps nothing (its input, the frozen
    patch embeddings', needs no gradient). Qwen2.5-VL also keeps its rotary cos and sin (fp32, head_dim
    each) and two int64 window orders a merged token. Measured: Idefics3's for every case of
    `vision_layer_bytes_per_patch`; Qwen2.5-VL's for full fine-tuning in fp32."""
    d, c = shape.hidden, run.dtype_bytes
    full = METHODS[run.method].trains_base_weights
    trained = full or adapted
    if shape.gated_mlp:
        rotary = 2 * 4 * (d // shape.heads)
        # the merger's RMSNorm (input, rsqrt), its MLP's GELU input; trained: the norm's normalized input and
        # output (the MLP's input) and the second linear's input
        merger = 4 * d + 4 + (4 * c * d if trained else c * d)
        pixels = patch_pixels * c if full else 0
        return rotary + 4 + merger + pixels
    norm = c * d + norm_stats_bytes(run)
    tail = norm + (c * d if trained else 0)
    if full:
        tail += patch_pixels * c + 8
    elif adapted and not checkpointing:
        tail -= norm
    return tail
