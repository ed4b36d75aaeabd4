"""Activation memory: bytes a Llama-style decoder saves for backward, per token (pure: stdlib only).

Where the coefficients come from: scripts/measure_activations.py counts, under
`torch.autograd.graph.saved_tensors_hooks`, the distinct storages autograd keeps
(parameters and the shared rotary cos/sin excluded) for transformers 5.24's
LlamaDecoderLayer / Qwen2DecoderLayer with bf16 weights, batch 1, SDPA, on CPU
(torch 2.13, peft 0.21, bitsandbytes 0.50), over 10 layer shapes from hidden 256
to 8192; the measurements are in activations.json next to this file. Every term
below is an integer count of saved tensors and reproduces every measurement to
the byte (tests/test_activations.py checks it). Rerun the script after upgrading
torch, transformers or peft.

Symbols: h hidden, I intermediate, H heads, KV kv heads, d head dim, r LoRA rank,
a adapter bytes (2 bf16, 4 fp32). Per layer, without checkpointing:

    full FT           16h +  8I +  4Hd + 4KVd + 4H + 8
    LoRA/QLoRA a=2    12h +  8I +  4Hd + 4KVd + 4H + 8 + 7ra
    LoRA/QLoRA a=4    28h + 10I +  8Hd + 4KVd + 4H + 8 + 7ra
    dropout > 0       (8h + 8) + (4Hd + 4KVd + 4H) + 6I + 2a(5h + Hd + I) + 7ra

Caveats: measured on CPU. There, dropout keeps an a-byte noise tensor per
adapted input; CUDA's fused dropout keeps a 1-byte mask instead, so with dropout
this over-counts by (a - 1)(5h + Hd + I) on a GPU (conservative). CUDA's flash /
memory-efficient SDPA keep the same output and fp32 logsumexp (4H, possibly
padded to a multiple of 32-128 tokens) plus a few bytes of RNG state. Eager
attention would add a term growing with sequence length; it is not modelled.
"""

from __future__ import annotations

METHODS = ("full", "lora", "qlora")


def layer_bytes_per_token(
    *,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    method: str,
    adapter_bytes: int = 2,
    lora_dropout: bool = False,
    checkpointing: bool = False,
    attention_bias: bool = False,
    lora_rank: int = 16,
    autocast: bool = False,
) -> int:
    """Bytes one decoder layer keeps for backward per token (bf16 weights, SDPA).

    `autocast` (full fine-tuning only): fp32 weights under bf16 autocast, as the trainer runs full
    fine-tuning without DeepSpeed. The residual stream is then fp32: 10 x hidden more a layer, and
    with checkpointing the kept input is fp32 (4 x hidden). Autocast's bf16 copy of every weight is
    saved too, a constant per layer, not per token (`autocast_weight_copy_bytes`).

    `method` is "full", "lora" or "qlora" (LoRA on all seven projections; QLoRA
    measures the same as LoRA: the NF4 base keeps nothing per token). With
    `checkpointing` this is what each checkpointed layer keeps, its bf16 input
    (2 x hidden); the planner must add ONE layer's non-checkpointed figure for
    the layer being recomputed during backward. `attention_bias` (Qwen2's q/k/v
    biases) changes nothing: measured, the bias add keeps no tensor.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if adapter_bytes not in (2, 4):
        raise ValueError(f"adapter_bytes must be 2 (bf16) or 4 (fp32), got {adapter_bytes!r}")
    h, inter, q_dim, kv_dim = hidden, intermediate, heads * head_dim, kv_heads * head_dim
    if autocast and method != "full":
        raise ValueError("autocast applies to full fine-tuning (adapters train on a 16-bit base)")
    if checkpointing:
        return (4 if autocast else 2) * h  # the layer input, saved by torch.utils.checkpoint
    # attention: q and k after rotary, v (all bf16), SDPA's output (bf16) and fp32 logsumexp per head;
    # o_proj's input is a view of SDPA's output.
    attention = 2 * q_dim + 2 * kv_dim + 2 * kv_dim + 2 * q_dim + 4 * heads
    # each RMSNorm: its fp32 upcast of the input, and the fp32 rsqrt per token
    norms = 2 * (4 * h + 4)
    # gate, up and silu(gate) outputs, bf16
    mlp = 3 * 2 * inter
    if method == "full":
        # each RMSNorm also keeps its bf16 normalized input to the weight product (for the norm weight's
        # grad) and its output (for the projections' weight grads); down_proj keeps act*up.
        # under autocast, the fp32 residual stream: the norms' inputs and normalized outputs are fp32 and
        # each projection saves its own bf16 cast of its input (measured: exactly 10 x hidden more)
        return norms + 2 * (2 * h + 2 * h) + attention + mlp + 2 * inter + (10 * h if autocast else 0)
    a = adapter_bytes
    lora_a_outputs = 7 * lora_rank * a  # kept by each lora_B
    if lora_dropout:
        # per adapted input (q, k, v, gate, up: h; o: H*d; down: I): the dropout noise and its output, a bytes each
        adapter_inputs = 2 * a * (5 * h + q_dim + inter)
    elif a == 4:
        # PEFT casts each adapter's input to fp32 separately: five copies of h, one of H*d, one of I
        adapter_inputs = a * (5 * h + q_dim + inter)
    else:
        # bf16 adapters keep the base layers' own inputs: the two norm outputs and act*up (o's is SDPA's)
        adapter_inputs = 2 * h + 2 * h + 2 * inter
    return norms + attention + mlp + adapter_inputs + lora_a_outputs


def model_bytes_per_token(
    *,
    hidden: int,
    vocab: int,
    plain_loss: bool = True,
    trainable_head: bool = True,
    chunked_loss: bool = False,
    autocast: bool = False,
) -> int:
    """Bytes kept once per model per token: final RMSNorm, lm_head input, plain cross-entropy.

    Measured with transformers' ForCausalLMLoss (fp32 upcast of the logits): the fp32
    log-softmax (4 x vocab) and the int64 labels (8). `plain_loss=False` leaves out both
    (the planner counts the loss's peak in its own term). A frozen head and norm (LoRA,
    QLoRA: `trainable_head=False`) keep 4 x hidden less. With `chunked_loss` the model
    never runs its head, so a trainable head's input is not saved there (the chunked
    loss returns the hidden states' gradient instead, counted with the loss). Under `autocast` (full
    fine-tuning with fp32 weights) the final norm's normalized input is fp32: 2 x hidden more.
    """
    h = hidden
    kept = 4 * h + 4  # the norm's fp32 upcast and rsqrt
    if trainable_head:
        kept += 2 * h  # normalized bf16 input of the norm weight
        if autocast:
            kept += 2 * h  # ... in fp32
        if not chunked_loss:
            kept += 2 * h  # lm_head's input
    if plain_loss:
        kept += 4 * vocab + 8
    return kept


def autocast_weight_copy_bytes(linear_params: int) -> int:
    """Autocast's bf16 copies of fp32 weights, saved for backward: 2 bytes a weight of every linear that ran.

    Measured per layer (and for the LM head under a plain loss), whatever the token count; with
    checkpointing only the layer being recomputed holds its copies.
    """
    return 2 * linear_params
