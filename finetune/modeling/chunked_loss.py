"""Exact causal-LM loss that never materialises the full fp32 logits.

A plain loss builds [tokens, vocab] fp32 logits (4.2 GB at 8,192 tokens and a
128k vocabulary) and peaks at two to three times that in backward. Here the LM
head and the cross-entropy are fused and run chunk by chunk over flattened 2-D
rows: each chunk's gradients are computed in the forward, the hidden-state
gradient into one [N, h] buffer and the head gradient (when the head trains)
accumulated into one [V, h] buffer, so the peak is a chunk of logits. The
result equals transformers' ``ForCausalLMLoss`` up to fp32 rounding.

With ``train.liger`` on (CUDA, ``liger-kernel`` installed), Liger's fused
Triton kernel is used instead (same semantics); off, ours runs even where Liger
is installed, so the switch alone decides.

The trainer runs it inside the model's forward (`add_chunked_loss_head`): there
the head is whole (DeepSpeed ZeRO-3 gathers it for the call, FSDP2's root unit
holds it unsharded), autocast is on as for the model's own head, and only the
last hidden state is built (asking the model for `output_hidden_states` would
keep, and under mixed precision copy to fp32, every layer's).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any

import torch
import torch.nn.functional as F

# Rows per chunk: a [1024, V] fp32 chunk of logits (0.5 GB at V = 128,256). At
# 4,096 tokens on 2 CPU cores the loss peak is 11x below the plain loss's, and
# the step no slower (BENCHMARKS.md, scripts/bench_loss.py).
DEFAULT_CHUNK_SIZE = 1024

IGNORE_INDEX = -100


def liger_available() -> bool:
    """Whether ``liger_kernel`` is importable (checked without importing it)."""
    return importlib.util.find_spec("liger_kernel") is not None


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision logits are upcast to fp32 for the softmax; fp32 and fp64 stay."""
    return torch.promote_types(dtype, torch.float32)


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 accumulator from 16-bit ``a`` and ``b``, without rounding each product.

    Rounding every chunk's contribution to the head gradient to bf16 before summing biases training
    (TRL's chunked log-prob kernel makes the same point); CUDA multiplies bf16 into fp32 directly.
    """
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and hasattr(torch, "float8_e4m3fn"):  # torch >= 2.8: out_dtype on CUDA
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _chunk_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    index: torch.Tensor | None,
    start: int,
    end: int,
    token_scale: torch.Tensor | float,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    grad_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Summed loss of rows ``start:end`` (or of the rows ``index``), adding their gradients in place.

    ``hidden``, ``weight`` and ``bias`` are in the compute dtype; the logits and their gradient are fp32,
    the head's gradient accumulates in fp32, the hidden states' gradient is written in its buffer's dtype.
    """
    if index is None:
        x, target = hidden[start:end], targets[start:end]
    else:
        x, target = hidden.index_select(0, index), targets.index_select(0, index)
    logits = torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()
    logits = logits.to(_loss_dtype(logits.dtype))  # no copy in fp32; a bf16 chunk is freed here
    target_logit = logits.gather(1, target.unsqueeze(1))
    row_max = logits.amax(dim=1, keepdim=True)
    exp = logits.sub_(row_max).exp_()  # in place: one [chunk, V] fp32 buffer
    sum_exp = exp.sum(dim=1, keepdim=True)
    loss_sum = (row_max + sum_exp.log() - target_logit).sum()
    if grad_hidden is None and grad_weight is None and grad_bias is None:
        return loss_sum
    # d loss / d logits = (softmax - one_hot) * token_scale
    grad_logits = exp.mul_(token_scale / sum_exp)
    grad_logits[torch.arange(end - start, device=target.device), target] -= token_scale
    if grad_bias is not None:
        grad_bias += grad_logits.sum(dim=0)
    grad_logits = grad_logits.to(hidden.dtype)
    if grad_hidden is not None:
        if index is None and grad_hidden.dtype == grad_logits.dtype:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        elif index is None:
            grad_hidden[start:end] = grad_logits @ weight
        else:
            grad_hidden.index_copy_(0, index, (grad_logits @ weight).to(grad_hidden.dtype))
    if grad_weight is not None:
        _addmm_fp32(grad_weight, grad_logits.t(), x)
    return loss_sum


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Fused ``cross_entropy(hidden @ weight.T + bias, targets)``, reduced by sum.

    The forward returns ``sum(token losses) / denominator`` (or the plain sum when
    ``denominator`` is None) and computes the matching gradients as it goes; the
    backward only scales them by ``grad_output``. Backward runs once per forward
    (the stored gradients are handed over, not copied).

    The matmuls run in ``compute_dtype`` (the inputs are cast once, inside, so a cast
    copy of the head lives only during the forward); each gradient comes back in its
    input's dtype, the head's accumulated in fp32 first.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        denominator: torch.Tensor | None,
        chunk_size: int,
        ignore_index: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        need_hidden_grad, need_weight_grad, need_bias_grad = ctx.needs_input_grad[:3]
        num_rows = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if need_hidden_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=_loss_dtype(weight.dtype), device=weight.device)
            if need_weight_grad
            else None
        )
        loss_dtype = _loss_dtype(compute_dtype)
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=loss_dtype, device=weight.device) if need_bias_grad else None
        )
        x_all = hidden.to(compute_dtype)
        w_all = weight.to(compute_dtype)
        b_all = None if bias is None else bias.to(compute_dtype)
        # Gradient of the loss with respect to each token's loss.
        token_scale = 1.0 / denominator if denominator is not None else 1.0

        # Only rows with a label cost anything (prompt tokens in SFT are skipped).
        rows = (targets != ignore_index).nonzero().squeeze(1)
        all_rows = rows.numel() == num_rows
        total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        for start in range(0, rows.numel(), chunk_size):
            end = min(start + chunk_size, rows.numel())
            # One chunk per call, so its [chunk, V] logits are freed before the next is made.
            total += _chunk_loss_and_grads(
                x_all,
                w_all,
                b_all,
                targets,
                None if all_rows else rows[start:end],
                start,
                end,
                token_scale,
                grad_hidden,
                grad_weight,
                grad_bias,
            )
        del x_all, w_all, b_all  # the cast copies (the head's is V x h) go before the backward
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None and bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        return total / denominator if denominator is not None else total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError(
                "chunked loss: backward ran twice through one forward (retain_graph); "
                "recompute the loss instead"
            )
        # Drop our reference so autograd can take the buffers without copying them.
        grads, ctx.grads = ctx.grads, None
        scaled = tuple(g.mul_(grad_output.to(g.dtype)) if g is not None else None for g in grads)
        return (*scaled, None, None, None, None, None)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, targets)`` in fp32, chunk by chunk.

    ``hidden`` is [N, h] and ``targets`` [N]. ``reduction`` is "mean" (over tokens
    whose target is not ``ignore_index``) or "sum"; ``num_items_in_batch``, when
    given, replaces both: the loss is the sum divided by it, as transformers does
    for gradient accumulation. As with ``F.cross_entropy``, a mean over no tokens is nan.
    ``compute_dtype`` (default: ``hidden``'s) is the dtype of the matmuls.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, h] and weight [V, h], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    compute_dtype = compute_dtype or hidden.dtype
    hidden, targets = hidden.contiguous(), targets.to(hidden.device)
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device).to(_loss_dtype(compute_dtype))
    elif reduction == "mean":
        denominator = (targets != ignore_index).sum().to(_loss_dtype(compute_dtype))
    else:
        denominator = None
    loss: torch.Tensor = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, targets, denominator, chunk_size, ignore_index, compute_dtype
    )
    return loss


def _liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,  # the kernel chooses its own chunks
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    reduction = "sum" if num_items_in_batch is not None else reduction
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)
    loss = loss_fn(weight, hidden, targets.to(hidden.device), bias)
    if isinstance(loss, tuple):  # versions that can also return a z-loss
        loss = loss[0]
    if num_items_in_batch is not None:
        loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
    return loss


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
    use_liger: bool = False,
) -> torch.Tensor:
    """Fused LM head + cross-entropy: Liger's kernel when asked (`use_liger`, CUDA tensors, installed), else ours.

    The head's matmul runs in one dtype, as the model's own head would: under
    autocast (the trainer computes the loss inside the model's forward, which
    accelerate autocasts) the autocast dtype; otherwise the head weight's dtype
    (accelerate's mixed-precision wrapper hands back fp32 hidden states while a
    LoRA base keeps its head in bf16). The chunks run with autocast off, so every
    buffer has that one dtype; the softmax is fp32 whatever it is.
    """
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
    with torch.autocast(device_type=device, enabled=False) if autocast else contextlib.nullcontext():
        if use_liger and hidden.is_cuda and liger_available():
            # Liger's kernel takes one dtype; its casts are ordinary autograd ops.
            return _liger_linear_cross_entropy(
                hidden.to(dtype),
                weight.to(dtype),
                targets,
                bias=None if bias is None else bias.to(dtype),
                reduction=reduction,
                num_items_in_batch=num_items_in_batch,
                chunk_size=chunk_size,
                ignore_index=ignore_index,
            )
        return chunked_linear_cross_entropy(
            hidden,
            weight,
            targets,
            bias=bias,
            reduction=reduction,
            num_items_in_batch=num_items_in_batch,
            chunk_size=chunk_size,
            ignore_index=ignore_index,
            compute_dtype=dtype,
        )


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_items_in_batch: torch.Tensor | int | None = None,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    use_liger: bool = False,
) -> torch.Tensor:
    """The causal-LM loss of ``hidden_states`` [..., h] under the LM head, without full logits.

    Same semantics as transformers' ``ForCausalLMLoss``: token t predicts
    ``labels[..., t + 1]`` (the last position is ignored), unless ``shift_labels``
    is given already shifted; the mean over non-ignored tokens, or the sum divided
    by ``num_items_in_batch`` when given.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # 2-D rows: MEMORY_MODEL.md, "The two traps"
    return linear_cross_entropy(
        hidden,
        lm_head_weight,
        shift_labels.reshape(-1),
        bias=lm_head_bias,
        num_items_in_batch=num_items_in_batch,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        use_liger=use_liger,
    )


def add_chunked_loss_head(model: Any, chunk_size: int = DEFAULT_CHUNK_SIZE, use_liger: bool = False) -> Any:
    """Teach a transformers causal LM `model(..., labels=y, chunked_loss=True, num_items_in_batch=n)`.

    `shift_labels=y` (already shifted, as a sequence split's shards carry them) replaces `labels`. That call runs the backbone for its last hidden state and `chunked_causal_lm_loss` under the LM head,
    inside the model's forward, and returns a `CausalLMOutputWithPast` holding only the loss (no
    logits). Inside the forward means inside every wrapper's hooks: DDP's, DeepSpeed ZeRO-3's (the
    head is gathered for the call with TRL's `maybe_gather_lm_head_ctx`; its gradient, made in the
    forward, reaches ZeRO's reduction in the backward as any parameter's would) and FSDP2's (the
    root unit holds the head unsharded during the forward; a DTensor head is gathered whole). Any
    other call is the model's own forward, untouched (generation, TRL's fused head).

    A PEFT model is patched underneath (`get_base_model()`), and its forward passes the keyword
    through. Patching twice is a no-op. `use_liger` (`train.liger`): Liger's fused kernel on CUDA.
    Returns `model`.
    """
    import functools
    import types

    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):  # PEFT
        add_chunked_loss_head(get_base_model(), chunk_size, use_liger)
        return model
    if getattr(model, "_finetune_chunked_loss", False):
        return model
    original_forward = model.forward

    @functools.wraps(type(model).forward)  # the model's signature: generate() validates its kwargs against it
    def forward(self: Any, *args: Any, chunked_loss: bool = False, **kwargs: Any) -> Any:
        if not chunked_loss:
            return original_forward(*args, **kwargs)
        from torch.distributed.tensor import DTensor
        from transformers.modeling_outputs import CausalLMOutputWithPast
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        # Under a sequence split each rank holds a shard of the sequence and its labels come pre-shifted
        # (`shift_labels`, deepspeed's UlyssesSPDataLoaderAdapter): a shard's last token predicts the next
        # shard's first, which only the whole sequence's shift knows.
        labels = kwargs.pop("labels", None)
        shift_labels = kwargs.pop("shift_labels", None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("output_hidden_states", None)
        kwargs["use_cache"] = False
        # a mixture of experts asked for its router logits (TRL sets the config for the auxiliary loss)
        router = kwargs.get("output_router_logits")
        if router is None:
            router = bool(getattr(self.config, "output_router_logits", False))
        if router:
            kwargs["output_router_logits"] = True
        backbone = self.base_model(*args, **kwargs)
        hidden = backbone.last_hidden_state  # the backbone: the final norm's output
        head = self.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):  # FSDP2 outside its root's forward: gather the head once
            weight = weight.full_tensor()
            bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
        with maybe_gather_lm_head_ctx(weight, bias):
            loss = chunked_causal_lm_loss(
                hidden,
                weight,
                labels,
                chunk_size=chunk_size,
                num_items_in_batch=num_items_in_batch,
                lm_head_bias=bias,
                shift_labels=shift_labels,
                use_liger=use_liger,
            )
        if not router:
            return CausalLMOutputWithPast(loss=loss)
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        # the load-balancing loss as the model's own forward computes it (its module's function and arguments);
        # the trainer weights and adds it, as TRL's compute_loss does on its own loss path
        balance = sys.modules[type(self).__module__].load_balancing_loss_func
        aux_loss = balance(
            backbone.router_logits, self.num_experts, self.num_experts_per_tok, kwargs.get("attention_mask")
        )
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)
    model._finetune_chunked_loss = True
    return model
