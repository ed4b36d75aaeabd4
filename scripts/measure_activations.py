"""Measure the bytes a decoder layer saves for backward, per token.

The pre-flight planner's activation formulas (finetune/planner/activations.py)
are fitted to these measurements. For each layer shape and training case this
builds one transformers decoder layer (LlamaDecoderLayer; Qwen2DecoderLayer for
shapes with q/k/v biases) with bf16 weights, runs a forward pass on CPU (batch
1, SDPA attention) under `torch.autograd.graph.saved_tensors_hooks`, and counts
the storages autograd keeps for backward: each storage once (by data pointer),
module parameters and the shared rotary cos/sin excluded. The layer input
requires grad, as it does for every layer but the first in a real model.

Cases: full fine-tuning; LoRA r=16 on all seven projections with fp32 adapters
(PEFT's default upcast) or bf16 adapters, without dropout or with dropout 0.05;
fp32 adapters under bf16 autocast (what the trainer runs: accelerate's mixed
precision); everything in fp32 (method.precision=fp32); packed rows (a
block-diagonal boolean mask, two samples per row: per layer the measurement is
then a per-token figure plus the mask's [T, T] bias, `attention_mask_bytes`);
non-reentrant activation checkpointing around the layer (full and LoRA); QLoRA
(bitsandbytes NF4 Linear4bit + bf16 LoRA) where bitsandbytes runs on the CPU.
Also the once-per-model term: final RMSNorm + lm_head + transformers' plain
causal-LM cross-entropy in fp32, with a trainable head (full fine-tuning) and
a frozen one (LoRA/QLoRA).

Families besides Llama/Qwen2 (`FAMILY_SHAPES`: Qwen3's q/k norms, Gemma 3's four norms and fp32 norm
product, Phi-3/4's fused qkv_proj and gate_up_proj) are measured on three small shapes each, through
their own transformers decoder layer and their own LoRA targets (`--families` re-measures only those).
Mixtures of experts (`MOE_SHAPES`: Qwen3-MoE's, Mixtral's and gpt-oss's sparse layers, transformers' grouped_mm
experts) are measured under LoRA on attention and on the fused experts, and full fine-tuning (`--moe`
re-measures only those). gpt-oss runs eager attention (transformers gives its sinks no SDPA path), so its rows
also hold each layer's softmax output over [T, T + 1] (`eager_scores_bytes`).

Writes every measurement to finetune/planner/activations.json and prints
measured vs formula. Takes about 11 minutes on 2 CPU cores (the 70B layer has
1.7 GB of bf16 weights); needs about 8 GB of RAM.

Usage:
    python scripts/measure_activations.py                       # measure all, write the json
    python scripts/measure_activations.py --cases lora_fp32_autocast,full_fp32   # re-measure some, keep the rest
    python scripts/measure_activations.py --families            # re-measure the other families' rows only
    python scripts/measure_activations.py --moe                 # re-measure the sparse layers' rows only
    python scripts/measure_activations.py --check               # only compare the stored json with the formula
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "finetune" / "planner" / "activations.json"

# name: (hidden, intermediate, heads, kv_heads, head_dim, attention_bias)
SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "llama3_1_8b": (4096, 14336, 32, 8, 128, False),
    "qwen2_5_32b": (5120, 27648, 40, 8, 128, True),
    "llama3_1_70b": (8192, 28672, 64, 8, 128, False),
    "llama3_2_1b": (2048, 8192, 32, 8, 64, False),
    "llama3_2_3b": (3072, 8192, 24, 8, 128, False),
    "qwen2_5_0_5b": (896, 4864, 14, 2, 64, True),
    "qwen2_5_1_5b": (1536, 8960, 12, 2, 128, True),
    "small_mha": (256, 688, 4, 4, 64, False),
    "small_gqa": (512, 1536, 8, 2, 64, False),
    "odd": (384, 1000, 6, 3, 32, False),
    "wide_head": (640, 1792, 4, 2, 160, False),
}
BIG = ("llama3_1_8b", "qwen2_5_32b", "llama3_1_70b")
# name: (family, dims): families whose decoder layer differs from Llama's (finetune/core/architectures.py
# says how); Phi's head_dim is always hidden / heads
FAMILY_SHAPES: dict[str, tuple[str, tuple[int, int, int, int, int, bool]]] = {
    f"{family}_{i}": (family, dims)
    for family in ("qwen3", "gemma3_text", "phi3")
    for i, dims in enumerate(
        [(256, 640, 4, 2, 64, False), (384, 1000, 6, 3, 64, False), (512, 1536, 8, 2, 64, False)]
        if family == "phi3"
        else [(256, 640, 4, 2, 64, False), (384, 1000, 6, 3, 32, False), (512, 1536, 8, 2, 128, False)]
    )
}

# case name: the LayerRun of layer_bytes_per_token (the layer's shape is the measured one)
CASES: dict[str, dict[str, Any]] = {
    "full": dict(method="full"),
    "lora_fp32": dict(method="lora", adapter_bytes=4),
    "lora_bf16": dict(method="lora", adapter_bytes=2),
    "lora_fp32_dropout": dict(method="lora", adapter_bytes=4, lora_dropout=True),
    "lora_bf16_dropout": dict(method="lora", adapter_bytes=2, lora_dropout=True),
    "full_ckpt": dict(method="full", checkpointing=True),
    "lora_fp32_ckpt": dict(method="lora", adapter_bytes=4, checkpointing=True),
    "qlora": dict(method="qlora", adapter_bytes=2),
    "qlora_dropout": dict(method="qlora", adapter_bytes=2, lora_dropout=True),
    "lora_bf16_r64": dict(method="lora", adapter_bytes=2, lora_rank=64),
    # what the trainer runs: accelerate's bf16 autocast around a bf16 base with fp32 adapters
    "lora_fp32_autocast": dict(method="lora", adapter_bytes=4, autocast=True),
    "lora_fp32_autocast_dropout": dict(method="lora", adapter_bytes=4, autocast=True, lora_dropout=True),
    # method.precision=fp32: every weight and activation fp32
    "full_fp32": dict(method="full", dtype_bytes=4),
    "lora_fp32_base": dict(method="lora", adapter_bytes=4, dtype_bytes=4),
    "lora_fp32_base_dropout": dict(method="lora", adapter_bytes=4, dtype_bytes=4, lora_dropout=True),
    # bf16 adapters on an fp32 base (QLoRA's bf16 default where the precision is fp32, as on the CPU)
    "lora_bf16_fp32_base": dict(method="lora", adapter_bytes=2, dtype_bytes=4),
    # packed rows: a block-diagonal boolean mask (two samples per row), as transformers builds from position_ids
    "full_packed": dict(method="full", packed=True),
    "lora_bf16_packed": dict(method="lora", adapter_bytes=2, packed=True),
    "full_fp32_packed": dict(method="full", dtype_bytes=4, packed=True),
}
# too slow to quantize or not informative at the big shapes (the small ones cover them)
SMALL_ONLY = (
    "qlora", "qlora_dropout", "lora_bf16_r64", "lora_fp32_autocast_dropout", "full_fp32", "lora_fp32_base",
    "lora_fp32_base_dropout", "full_packed", "lora_bf16_packed", "full_fp32_packed", "lora_bf16_fp32_base",
)  # fmt: skip
# the other families: every case but QLoRA's (its layer measures as LoRA's), and full fine-tuning under autocast
CASES["full_autocast"] = dict(method="full", autocast=True)
FAMILY_CASES = tuple(c for c in CASES if not c.startswith("qlora"))
# Mixtures of experts' sparse layers (`--moe`): name: (family, dims with I the expert's width, experts, routed a
# token, the router's norm_topk_prob), through transformers' grouped_mm experts (the path its models take)
MOE_SHAPES: dict[str, tuple[str, tuple[int, int, int, int, int, bool], int, int, bool]] = {
    "qwen3_moe_0": ("qwen3_moe", (256, 128, 4, 2, 64, False), 8, 2, False),
    "qwen3_moe_1": ("qwen3_moe", (384, 200, 6, 3, 32, False), 6, 3, True),
    "mixtral_0": ("mixtral", (256, 128, 4, 2, 64, False), 8, 2, True),
    "mixtral_1": ("mixtral", (384, 200, 6, 3, 32, False), 6, 3, True),
    "mixtral_2": ("mixtral", (512, 320, 8, 2, 64, False), 8, 2, True),
    # gpt-oss: eager attention with sinks (transformers gives it no SDPA), a softmax over the top-k router
    # logits, the clamped SwiGLU with biased experts
    "gpt_oss_0": ("gpt_oss", (64, 48, 4, 2, 16, True), 4, 2, False),
    "gpt_oss_1": ("gpt_oss", (256, 128, 4, 2, 64, True), 8, 2, False),
    "gpt_oss_2": ("gpt_oss", (384, 200, 6, 3, 32, True), 6, 3, False),
}
# LoRA on attention (the router frozen), and on the fused experts too (PEFT's target_parameters; no dropout)
MOE_CASES: dict[str, dict[str, Any]] = {
    "moe_lora_bf16": dict(method="lora", adapter_bytes=2),
    "moe_lora_bf16_experts": dict(method="lora", adapter_bytes=2, expert_adapters=True),
    "moe_lora_fp32_autocast_experts": dict(
        method="lora", adapter_bytes=4, autocast=True, expert_adapters=True
    ),
    "moe_lora_fp32_base_experts": dict(method="lora", adapter_bytes=4, dtype_bytes=4, expert_adapters=True),
    # full fine-tuning: every expert and the router trained (bf16; fp32 weights under autocast; all fp32)
    "moe_full": dict(method="full"),
    "moe_full_autocast": dict(method="full", autocast=True),
    "moe_full_fp32": dict(method="full", dtype_bytes=4),
}
ALL_CASES = {**CASES, **MOE_CASES}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HEAD_VOCABS = (1000, 8192, 32000)
HEAD_HIDDENS = (256, 1024, 4096)


class SavedBytes:
    """Context manager: total bytes of the distinct storages autograd saves, minus excluded ones."""

    def __init__(self, exclude: list[Any]):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t: Any) -> Any:
        s = t.untyped_storage()
        if s.data_ptr() not in self._exclude and s.nbytes() > 0:
            self.storages[s.data_ptr()] = s.nbytes()
        return t  # keeps the tensor alive, so a data pointer is never reused during the count

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _config(shape: tuple[int, int, int, int, int, bool]) -> Any:
    hidden, inter, heads, kv, head_dim, bias = shape
    common = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=1,
        vocab_size=256,
        max_position_embeddings=4096,
    )
    if bias:
        from transformers import Qwen2Config

        cfg = Qwen2Config(**common)
    else:
        from transformers import LlamaConfig

        cfg = LlamaConfig(**common)
    cfg._attn_implementation = "sdpa"
    return cfg


def _init_(module: Any) -> None:
    """Cheap deterministic weights (the values do not matter, only that they are finite)."""
    import torch

    block = torch.empty(1 << 16).uniform_(-0.02, 0.02, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # tiling one random block is memcpy-fast; a 70B layer has 855M weights
                flat = p.view(-1)
                for i in range(0, flat.numel(), block.numel()):
                    n = min(block.numel(), flat.numel() - i)
                    flat[i : i + n] = block[:n]


def _to_qlora(layer: Any) -> None:
    """Swap every nn.Linear of the layer for a bitsandbytes NF4 Linear4bit, quantized on the CPU."""
    import bitsandbytes as bnb
    import torch

    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                q = q.to("cpu")  # quantizes
                if hasattr(q, "support_avx512bf16_for_cpu"):
                    q.support_avx512bf16_for_cpu = False
                setattr(parent, name, q)


def family_layer(family: str, shape: tuple[int, int, int, int, int, bool]) -> Any:
    """One decoder layer of another family's transformers class (bf16 weights), as `base_layer`."""
    import torch
    import transformers

    hidden, inter, heads, kv, head_dim, _ = shape
    kw: dict[str, Any] = dict(
        hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
        num_hidden_layers=1, vocab_size=256, max_position_embeddings=4096,
    )  # fmt: skip
    if family != "phi3":
        kw["head_dim"] = head_dim
    if family == "gemma3_text":  # a layer's attention type only changes the mask the model passes it
        kw["layer_types"] = ["full_attention"]
    config_cls, module, layer_cls = {
        "qwen3": ("Qwen3Config", "qwen3.modeling_qwen3", "Qwen3DecoderLayer"),
        "gemma3_text": ("Gemma3TextConfig", "gemma3.modeling_gemma3", "Gemma3DecoderLayer"),
        "phi3": ("Phi3Config", "phi3.modeling_phi3", "Phi3DecoderLayer"),
    }[family]
    cfg = getattr(transformers, config_cls)(**kw)
    cfg._attn_implementation = "sdpa"
    Layer = getattr(__import__(f"transformers.models.{module}", fromlist=[layer_cls]), layer_cls)
    with torch.device("meta"):
        layer = Layer(cfg, layer_idx=0)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    _init_(layer)
    return layer


def base_layer(shape: tuple[int, int, int, int, int, bool], family: str = "") -> Any:
    """One decoder layer with bf16 weights: LlamaDecoderLayer, or Qwen2DecoderLayer for q/k/v biases, or
    `family`'s own."""
    import torch

    if family:
        return family_layer(family, shape)
    cfg = _config(shape)
    if shape[5]:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as Layer
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer
    with torch.device("meta"):
        layer = Layer(cfg, layer_idx=0)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    _init_(layer)
    return layer


def build_layer(
    shape: tuple[int, int, int, int, int, bool], case: str, base: Any = None, family: str = ""
) -> Any:
    """A decoder layer prepared for `case` (see CASES); `base` (from base_layer) is copied, not changed."""
    import copy

    from finetune.core.architectures import ARCHITECTURES

    layer = copy.deepcopy(base) if base is not None else base_layer(shape, family)
    kw = CASES[case]
    if kw["method"] == "full":
        return layer.requires_grad_(True)
    if kw["method"] == "qlora":
        _to_qlora(layer)
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(
        r=kw.get("lora_rank", 16),
        lora_alpha=32,
        target_modules=list(ARCHITECTURES[family].projections) if family else LORA_TARGETS,
        lora_dropout=0.05 if kw.get("lora_dropout") else 0.0,
    )
    return get_peft_model(layer, lcfg, autocast_adapter_dtype=kw.get("adapter_bytes", 2) == 4)


def packed_mask(tokens: int) -> Any:
    """A block-diagonal causal boolean mask [1, 1, T, T]: two samples packed in one row."""
    import torch

    mask = torch.zeros(1, 1, tokens, tokens, dtype=torch.bool)
    half = tokens // 2
    for start, end in ((0, half), (half, tokens)):
        n = end - start
        mask[..., start:end, start:end] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    return mask


def measure_layer(
    shape: tuple[int, int, int, int, int, bool],
    case: str,
    tokens: int,
    layer: Any = None,
    autocast: bool = False,
    family: str = "",
) -> int:
    """Bytes saved for backward by one decoder layer over `tokens` tokens (batch 1).

    The case's `autocast` (or `autocast=True` here, for full fine-tuning): bf16 autocast around the
    forward, as accelerate runs it; full fine-tuning then has fp32 weights and an fp32 residual stream,
    LoRA a bf16 base with fp32 adapters. Autocast's bf16 weight copies are saved too, a constant per
    layer (the formula's per-token figure is the slope over two token counts). `dtype_bytes=4`: the layer
    (adapters included) and its input in fp32. `packed`: a two-sample block-diagonal mask, whose bias
    each layer saves (`attention_mask_bytes`, not per token).
    """
    import contextlib

    import torch
    from torch.utils.checkpoint import checkpoint

    kw = ALL_CASES[case]
    autocast = autocast or kw.get("autocast", False)
    hidden, head_dim = shape[0], shape[4]
    layer = layer if layer is not None else build_layer(shape, case)
    fp32 = kw.get("dtype_bytes", 2) == 4 or (autocast and kw["method"] == "full")
    dtype = torch.float32 if fp32 else torch.bfloat16
    if fp32:
        layer = layer.float()
        if kw.get("adapter_bytes") == 2 and kw["method"] != "full":
            for p in layer.parameters():  # finetune/modeling/models.py's cast of bf16 adapters
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    layer.train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=g).to(dtype).requires_grad_(True)
    position_ids = torch.arange(tokens)[None]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq  # as LlamaRotaryEmbedding.forward
    # gpt-oss rotates the two halves of a head with head_dim / 2 angles; the others repeat them
    emb = freqs if family == "gpt_oss" else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    mask = packed_mask(tokens) if kw.get("packed") else None
    kwargs = dict(attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))
    # the layer's parameters, and cos/sin and the boolean mask, which the model makes once for all its layers
    exclude = [p for p in layer.parameters()] + [cos, sin] + ([mask] if mask is not None else [])
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp, SavedBytes(exclude) as saved:
        if kw.get("checkpointing"):
            out = checkpoint(layer, x, use_reentrant=False, **kwargs)
        else:
            out = layer(x, **kwargs)
    assert out.requires_grad
    total = saved.total
    del out
    return total


def measure_head(hidden: int, vocab: int, tokens: int, trainable_head: bool, autocast: bool = False) -> int:
    """Bytes saved for backward by final RMSNorm + lm_head + plain fp32 cross-entropy (transformers' loss).

    `autocast`: fp32 norm, head and hidden states under bf16 autocast (full fine-tuning without
    DeepSpeed); the head's bf16 weight copy is then saved too, a constant.
    """
    import contextlib

    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dtype = torch.float32 if autocast else torch.bfloat16
    norm = LlamaRMSNorm(hidden).to(dtype)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
    _init_(head)
    norm.requires_grad_(trainable_head)
    head.requires_grad_(trainable_head)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, tokens, hidden, generator=g).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    exclude = list(norm.parameters()) + list(head.parameters())
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp, SavedBytes(exclude) as saved:
        loss = ForCausalLMLoss(head(norm(x)), labels, vocab_size=vocab)
    total = saved.total
    del loss
    return total


def formula(
    shape: tuple[int, int, int, int, int, bool],
    case: str,
    family: str = "",
    moe: tuple[int, int, bool] = (0, 0, False),
) -> int:
    """The formula's per-token bytes; `moe`: (experts, routed a token, norm_topk_prob) of a sparse layer."""
    from finetune.core.architectures import ARCHITECTURES
    from finetune.planner.activations import LayerRun, LayerShape, layer_bytes_per_token

    hidden, inter, heads, kv, head_dim, bias = shape
    facts: dict[str, bool] = {}
    if family:
        arch = ARCHITECTURES[family]
        facts = dict(
            fp32_norm_product=arch.fp32_norm_product, qk_norm=arch.qk_norm,
            sandwich_norms=arch.sandwich_norms, fused_projections=arch.fused_projections,
        )  # fmt: skip
        if moe[0]:
            facts.update(
                experts=moe[0], experts_per_token=moe[1], renormalized_routing=moe[2] or arch.fp32_routing_weights,
                fp32_routing_weights=arch.fp32_routing_weights, softmax_after_topk=arch.softmax_after_topk,
                clamped_swiglu=arch.clamped_swiglu, expert_biases=arch.expert_biases,
            )  # fmt: skip
    layer = LayerShape(
        hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, head_dim=head_dim, attention_bias=bias,
        **facts,
    )  # fmt: skip
    # a family transformers runs without SDPA (gpt-oss) is measured under eager attention, its CPU path
    eager = bool(family) and not ARCHITECTURES[family].sdpa
    return layer_bytes_per_token(layer, LayerRun(**ALL_CASES[case], attention="eager" if eager else "sdpa"))


def formula_bytes(row: dict[str, Any]) -> int:
    """The formula's bytes for a stored layer row: per token x tokens, plus the packed mask's bias and, under
    autocast, the bf16 copies of the adapters' fp32 weights (constants per layer)."""
    from finetune.planner.activations import attention_mask_bytes, autocast_weight_copy_bytes

    kw = ALL_CASES[row["case"]]
    tokens = row["tokens"]
    family = row.get("family", "")
    if "experts" in row:
        return moe_formula_bytes(row)
    out = formula(tuple(row["dims"]), row["case"], family) * tokens  # type: ignore[arg-type]
    if kw.get("packed"):
        out += attention_mask_bytes(tokens=tokens, rows=1, dtype_bytes=kw.get("dtype_bytes", 2))
    hidden, inter, heads, kv, head_dim, _ = row["dims"]
    if family == "gemma3_text" and not kw.get("checkpointing"):
        # each norm's fp32 (1 + weight), a constant per layer: four h-wide norms and the q and k norms
        out += 4 * (4 * hidden + 2 * head_dim)
    if kw.get("autocast") and kw["method"] == "full":  # the bf16 copy of every fp32 weight (fused or not)
        q_dim, kv_dim = heads * head_dim, kv * head_dim
        out += autocast_weight_copy_bytes(hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * inter)
    if kw.get("autocast") and kw["method"] != "full":
        per_rank = hidden + heads * head_dim + 2 * (hidden + kv * head_dim) + heads * head_dim + hidden
        per_rank += 2 * (hidden + inter) + inter + hidden
        if family == "phi3":  # qkv_proj and gate_up_proj read the hidden state once each, not 3 and 2 times
            per_rank -= 3 * hidden
        out += autocast_weight_copy_bytes(kw.get("lora_rank", 16) * per_rank)
    return out


def moe_formula_bytes(row: dict[str, Any]) -> int:
    """A sparse layer's row: per token x tokens, plus its constants: grouped_mm's int32 offsets (4 bytes an
    expert), the expert weights with their LoRA folded in, and under autocast the bf16 copies of the fp32
    adapters (attention's and the experts')."""
    from finetune.core.architectures import ARCHITECTURES
    from finetune.planner.activations import (
        LayerRun,
        LayerShape,
        autocast_weight_copy_bytes,
        eager_scores_bytes,
        folded_expert_bytes,
    )

    kw = MOE_CASES[row["case"]]
    hidden, inter, heads, kv, head_dim, _ = row["dims"]
    experts, k, norm = row["experts"], row["experts_per_token"], row["norm_topk_prob"]
    out = formula(tuple(row["dims"]), row["case"], row["family"], (experts, k, norm)) * row["tokens"]  # type: ignore[arg-type]
    shape = LayerShape(
        hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, head_dim=head_dim, experts=experts
    )
    run = LayerRun(**kw)
    out += 4 * experts + folded_expert_bytes(shape, run)
    if not ARCHITECTURES[row["family"]].sdpa:  # eager attention's softmax over [T, T + 1] (gpt-oss's sinks)
        out += eager_scores_bytes(heads=heads, tokens=row["tokens"], rows=1, run=run)
    if kw.get("autocast") and kw["method"] == "full":  # attention's and the router's bf16 copies
        q_dim, kv_dim = heads * head_dim, kv * head_dim
        out += autocast_weight_copy_bytes(hidden * (2 * q_dim + 2 * kv_dim) + experts * hidden)
    elif kw.get("autocast"):
        q_dim, kv_dim, r = heads * head_dim, kv * head_dim, 16
        adapters = r * (2 * (hidden + q_dim) + 2 * (hidden + kv_dim))
        if kw.get("expert_adapters"):
            adapters += r * experts * ((hidden + 2 * inter) + (inter + hidden))
        out += autocast_weight_copy_bytes(adapters)
    return out


def moe_layer(
    family: str, shape: tuple[int, int, int, int, int, bool], experts: int, k: int, norm: bool
) -> Any:
    """One sparse decoder layer of `family`'s transformers class (bf16 weights, grouped_mm experts, SDPA)."""
    import torch
    import transformers

    hidden, inter, heads, kv, head_dim, _ = shape
    kw: dict[str, Any] = dict(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        num_hidden_layers=1, vocab_size=256, num_experts_per_tok=k,
    )  # fmt: skip
    attention = "sdpa"
    if family == "mixtral":  # its experts' width is intermediate_size; it always renormalizes
        cfg = transformers.MixtralConfig(**kw, intermediate_size=inter, num_local_experts=experts)
        from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer as Layer
    elif family == "gpt_oss":  # layer 0 is a sliding-window layer: the window only changes the mask's content
        cfg = transformers.GptOssConfig(
            **kw, intermediate_size=inter, num_local_experts=experts, attention_bias=shape[5]
        )
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer as Layer  # type: ignore[assignment]

        attention = "eager"
    else:
        cfg = transformers.Qwen3MoeConfig(
            **kw,
            intermediate_size=4 * inter,
            moe_intermediate_size=inter,
            num_experts=experts,
            norm_topk_prob=norm,
        )
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer as Layer  # type: ignore[assignment]
    cfg._attn_implementation, cfg._experts_implementation = attention, "grouped_mm"
    with torch.device("meta"):
        layer = Layer(cfg, layer_idx=0)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    _init_(layer)
    return layer


def moe_case_layer(base: Any, family: str, case: str) -> Any:
    """A copy of the sparse layer `base` prepared for MOE_CASES[case]: every weight trained (full), or LoRA on
    attention (the router frozen) and, with `expert_adapters`, on the fused experts (no dropout)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from finetune.core.architectures import ARCHITECTURES

    kw, arch = MOE_CASES[case], ARCHITECTURES[family]
    if kw["method"] == "full":
        return copy.deepcopy(base).requires_grad_(True)
    lcfg = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(arch.projections),
        target_parameters=list(arch.expert_parameters) if kw.get("expert_adapters") else None,
    )  # fmt: skip
    return get_peft_model(copy.deepcopy(base), lcfg, autocast_adapter_dtype=kw["adapter_bytes"] == 4)


def measure_moe() -> list[dict[str, Any]]:
    """Every MOE_SHAPES x MOE_CASES row, at 64 and 128 tokens."""
    rows: list[dict[str, Any]] = []
    for name, (family, shape, experts, k, norm) in MOE_SHAPES.items():
        base = moe_layer(family, shape, experts, k, norm)
        for case in MOE_CASES:
            layer = moe_case_layer(base, family, case)
            for tokens in (64, 128):
                b = measure_layer(shape, case, tokens, layer, family=family)
                rows.append(
                    dict(
                        shape=name, family=family, dims=list(shape), experts=experts, experts_per_token=k,
                        norm_topk_prob=norm, case=case, tokens=tokens, bytes=b, bytes_per_token=b / tokens,
                    )
                )  # fmt: skip
            del layer
        print(f"  {name:14s} {len(MOE_CASES)} cases", flush=True)
    return rows


def qlora_works() -> bool:
    try:
        m = measure_layer(SHAPES["small_mha"], "qlora", 16)
    except Exception as e:  # bitsandbytes without a CPU backend
        print(f"QLoRA skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return False
    return m > 0


def _token_counts(shape: tuple[int, int, int, int, int, bool], case: str, name: str) -> tuple[int, ...]:
    """Two token counts where cheap; the per-token figure is exact at any count (checked at 64 vs 256)."""
    if shape[0] <= 1024:
        return (128, 256)
    if case == "full" and name not in ("qwen2_5_32b", "llama3_1_70b"):
        return (64, 256)
    return (64,)  # a bf16 matmul runs at ~5 GFLOP/s on 2 CPU cores: a 70B layer is 12 s for 64 tokens


def measure_all(only: Any = None) -> list[dict[str, Any]]:
    """Every shape x case (layer) and hidden x vocab (head); two token counts each, one for most big-shape cases.

    `only`: a set of case names to measure (the head rows are then skipped).
    """
    rows: list[dict[str, Any]] = []
    cases = [c for c in CASES if (only is None and c != "full_autocast") or (only and c in only)]
    if any(c.startswith("qlora") for c in cases) and not qlora_works():
        cases = [c for c in cases if not c.startswith("qlora")]
    for name, shape in SHAPES.items():
        big = name in BIG
        todo = [
            c for c in cases if not (big and c in SMALL_ONLY and not (name == "llama3_1_8b" and c == "qlora"))
        ]
        if not todo:
            continue
        base = base_layer(shape)
        for case in todo:
            t0 = time.time()
            layer = build_layer(shape, case, base)
            for tokens in _token_counts(shape, case, name):
                b = measure_layer(shape, case, tokens, layer)
                rows.append(
                    dict(
                        shape=name,
                        dims=list(shape),
                        case=case,
                        tokens=tokens,
                        bytes=b,
                        bytes_per_token=b / tokens,
                    )
                )
            del layer
            print(
                f"  {name:14s} {case:26s} {rows[-1]['bytes_per_token']:>12,.1f}  ({time.time() - t0:.1f}s)",
                flush=True,
            )
        del base
    if only is not None:
        return rows
    for trainable in (True, False):
        case = "head_trainable" if trainable else "head_frozen"
        for hidden in HEAD_HIDDENS:
            for vocab in HEAD_VOCABS:
                for tokens in (64, 128):
                    b = measure_head(hidden, vocab, tokens, trainable)
                    name = f"head_h{hidden}_v{vocab}"
                    rows.append(
                        dict(
                            shape=name,
                            dims=[hidden, vocab],
                            case=case,
                            tokens=tokens,
                            bytes=b,
                            bytes_per_token=b / tokens,
                        )
                    )
        print(f"  head ({case}) done", flush=True)
    return rows


def measure_families() -> list[dict[str, Any]]:
    """Every FAMILY_SHAPES x FAMILY_CASES row, at 128 and 256 tokens."""
    rows: list[dict[str, Any]] = []
    for name, (family, shape) in FAMILY_SHAPES.items():
        base = base_layer(shape, family)
        for case in FAMILY_CASES:
            layer = build_layer(shape, case, base, family)
            for tokens in (128, 256):
                b = measure_layer(shape, case, tokens, layer, family=family)
                rows.append(
                    dict(
                        shape=name, family=family, dims=list(shape), case=case, tokens=tokens, bytes=b,
                        bytes_per_token=b / tokens,
                    )
                )  # fmt: skip
            del layer
        print(f"  {name:14s} {len(FAMILY_CASES)} cases", flush=True)
    return rows


def report(rows: list[dict[str, Any]]) -> float:
    """Print measured vs formula; return the worst relative error."""
    from finetune.planner.activations import model_bytes_per_token

    worst = 0.0
    print(f"{'shape':16s} {'case':26s} {'tokens':>6s} {'measured':>14s} {'formula':>14s} {'error':>8s}")
    for r in rows:
        if r["case"].startswith("head"):
            hidden, vocab = r["dims"]
            f = r["tokens"] * model_bytes_per_token(
                hidden=hidden, vocab=vocab, trainable_head=r["case"] == "head_trainable"
            )
        else:
            f = formula_bytes(r)
        m = r["bytes"]
        err = (f - m) / m
        worst = max(worst, abs(err))
        print(f"{r['shape']:16s} {r['case']:26s} {r['tokens']:>6d} {m:>14,d} {f:>14,d} {err:>+8.3%}")
    print(f"worst relative error: {worst:.4%}")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare the stored json with the formula")
    parser.add_argument("--families", action="store_true", help="(re)measure only the other families' rows")
    parser.add_argument("--moe", action="store_true", help="(re)measure only the mixtures of experts' rows")
    parser.add_argument(
        "--cases", help="comma-separated cases to (re)measure; the json keeps every other row"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.check:
        rows = json.loads(JSON_PATH.read_text())["measurements"]
    else:
        import torch
        import transformers

        only = None
        if args.cases:
            only = set(args.cases.split(","))
            unknown = sorted(only - set(CASES))
            if unknown:
                parser.error(f"unknown cases: {', '.join(unknown)}")
        torch.manual_seed(0)
        t0 = time.time()
        if args.families:
            old = json.loads(JSON_PATH.read_text())["measurements"]
            rows = [r for r in old if "family" not in r or "experts" in r] + measure_families()
        elif args.moe:
            old = json.loads(JSON_PATH.read_text())["measurements"]
            rows = [r for r in old if "experts" not in r] + measure_moe()
        else:
            rows = measure_all(only)
            if only is not None:
                kept = [r for r in json.loads(JSON_PATH.read_text())["measurements"] if r["case"] not in only]
                rows = kept + rows
            if only is None:  # the other families' rows stay (`--families` re-measures them)
                old = json.loads(JSON_PATH.read_text())["measurements"]
                rows += [r for r in old if "family" in r]
        meta = dict(
            description="bytes saved for backward: per decoder layer (layer cases) or once per model (head_*), "
            "distinct storages, parameters, rotary cos/sin and the boolean mask excluded; batch 1, SDPA (eager "
            "attention for gpt-oss, which has no SDPA path), CPU; "
            "bytes_per_token = bytes / tokens (packed and autocast-LoRA rows also hold a per-layer constant, gpt-oss "
            "rows their softmax output)",
            script="scripts/measure_activations.py",
            torch=torch.__version__,
            transformers=transformers.__version__,
            seconds=round(time.time() - t0),
        )
        JSON_PATH.write_text(json.dumps(dict(meta=meta, measurements=rows), indent=1) + "\n")
        print(f"wrote {JSON_PATH} in {time.time() - t0:.0f}s")
    report(rows)


if __name__ == "__main__":
    main()
