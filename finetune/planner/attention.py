"""The attention path a plan takes, and the workspace it costs (pure: stdlib only).

Which kernel runs attention decides whether a [T, T] tensor exists. transformers gives SDPA a packed row's
block-diagonal mask, which SDPA turns into an additive [T, T] bias per layer (`attention_mask_bytes`,
measured on the CPU); without a mask (a sequence split drops it: Ulysses takes causality from position_ids)
SDPA runs its flash kernel on CUDA and keeps nothing T x T. FlexAttention builds a block mask from the
packed rows' position_ids instead: (T / 128)^2 small integers a row, no [T, T] tensor, and it keeps the
samples apart; it runs on CUDA only (no backward on the CPU). flash-attn (`train.attention=flash`) keeps
packed rows apart through its variable-length path, where the package is installed.

Eager attention (gpt-oss on the CPU: transformers gives it no SDPA) gets a float [T, T] mask the model makes
once per layer type, and each layer keeps its softmax output (`eager_scores_bytes`, measured).

When `train.attention` is unset the planner takes SDPA, the measured default, and on CUDA from the long-context
length on, for packed rows that stay on one rank, FlexAttention: the [T, T] bias is what stops a 128k-token
row from fitting (34 GB a layer at 131,072 tokens in bf16). A split keeps SDPA (mask-free: its flash kernel);
its packed rows need flash-attn (`engines.why_not_split` says so in one line).
"""

from __future__ import annotations

from typing import Any, Optional

from finetune.core.architectures import ARCHITECTURES
from finetune.planner.activations import LayerRun, eager_scores_bytes
from finetune.planner.contract import Strategy

# FlexAttention's block size (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE): the block mask
# holds, per row and per (query block, key block), an int32 index.
FLEX_BLOCK = 128
# The block mask's int32 tensors of [q blocks, kv blocks]: the partial and full blocks' indices, forward and
# transposed for the backward (BlockMask's kv_indices, full_kv_indices, q_indices, full_q_indices).
FLEX_INDEX_TENSORS = 4

# What each path is, for the plan's reasons.
LABELS = {
    "sdpa": "SDPA",
    "flex": "FlexAttention (a block mask from the packed rows' position_ids, no [T, T] tensor)",
    "flash": "flash-attn (variable-length over the packed rows, no mask)",
    "eager": "eager attention (the [T, T] scores kept)",
}


def choose(
    attention: Optional[str], model: Any, *, device: str, packing: bool, split: bool, long_context: bool
) -> str:
    """The attention implementation a candidate strategy runs: `train.attention` when set; else FlexAttention
    for packed rows on one CUDA rank from the long-context length on, SDPA otherwise. A family transformers
    runs without SDPA (gpt-oss, for its sinks) takes FlexAttention on CUDA and eager attention on the CPU."""
    if attention is not None:
        return attention
    if not ARCHITECTURES[model.architecture].sdpa:
        return "flex" if device == "cuda" else "eager"
    if device == "cuda" and packing and not split and long_context:
        return "flex"
    return "sdpa"


def takes_mask(s: Strategy) -> bool:
    """Whether each layer turns the packed rows' boolean mask into a [T, T] bias (SDPA does; FlexAttention takes
    a block mask, eager attention the model's float mask, `path_bytes`; flash-attn none: the collator flattens
    the rows and its variable-length kernel reads the samples' bounds from position_ids). A sequence split drops
    the mask (causality from position_ids)."""
    return s.split is None and s.attention not in ("flex", "eager", "flash")


def block_mask_bytes(*, tokens: int, rows: int) -> int:
    """FlexAttention's block mask for a micro-batch of `rows` rows of `tokens` tokens, held through the step
    (made once per forward, an input of every checkpointed layer). Modelled from BlockMask's layout, not
    measured (FlexAttention has no backward on the CPU)."""
    blocks = -(-tokens // FLEX_BLOCK)
    return rows * FLEX_INDEX_TENSORS * 4 * blocks * blocks


def path_bytes(model: Any, s: Strategy, *, tokens: int, rows: int, run: LayerRun) -> int:
    """What the attention path holds beyond the measured layer formulas, per GPU (`run`: how a layer runs):

    - FlexAttention: its block masks (`block_mask_bytes`, modelled); a sliding-window family (gpt-oss) has a
      second one for its sliding layers, bounded by the window: each query block sees at most window / 128 + 1
      key blocks.
    - eager attention: each layer's softmax output (`eager_scores_bytes`, measured), every layer's without
      checkpointing, the layer being recomputed's with it; and with checkpointing the model's float [T, T]
      masks, one per layer type (gpt-oss: full and sliding), in the embeddings' dtype, which the checkpoint
      keeps as every layer's input (without it they are freed when the forward returns, before the loss).
    """
    arch = ARCHITECTURES[model.architecture]
    if s.attention == "flex":
        held = block_mask_bytes(tokens=tokens, rows=rows)
        if arch.sliding_window:
            blocks = -(-tokens // FLEX_BLOCK)
            seen = min(blocks, -(-arch.sliding_window // FLEX_BLOCK) + 1)
            held += rows * FLEX_INDEX_TENSORS * 4 * blocks * seen
        return held
    if s.attention == "eager":
        scores = eager_scores_bytes(
            heads=model.num_heads, tokens=tokens, rows=rows, run=run, sinks=arch.attention_sinks
        )
        if not s.activation_checkpointing:
            return model.num_layers * scores
        mask_dtype = 4 if run.fp32_weights else run.dtype_bytes
        masks = (2 if arch.sliding_window else 1) * rows * tokens * tokens * mask_dtype
        return scores + masks
    return 0


def workspace_above_loss(*, working_set: float, mask_share: float, loss: float) -> float:
    """The attention path's share of the backward working set above the loss peak: what the [T, T] biases of
    the layer in backward (and of the one being recomputed) add there."""
    return max(0.0, working_set - loss) - max(0.0, working_set - mask_share - loss)


def describe(s: Strategy, set_by_user: bool) -> str:
    """The plan's line naming the attention path it took."""
    if s.attention == "sdpa":
        what = (
            "SDPA with the packed rows' block-diagonal mask (a [T, T] bias a layer)"
            if takes_mask(s)
            else "SDPA without a mask (the sequence split takes causality from position_ids: its flash kernel)"
        )
    else:
        what = LABELS[s.attention]
    return f"attention: {what}" + (" (train.attention)" if set_by_user else " (train.attention unset)")
