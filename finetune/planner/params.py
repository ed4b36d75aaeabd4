"""Exact parameter counts from the architecture (not from a rounded model name)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from finetune.core.architectures import ARCHITECTURES, LLAMA_PROJECTIONS
from finetune.core.config import MethodConfig, ModelConfig
from finetune.core.errors import ConfigError


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding (V x h)
    lm_head: int  # 0 when tied to the embedding
    linear_per_layer: (
        int  # the linear weights of one decoder layer (a MoE layer: every expert and the router)
    )
    other_per_layer: int  # norms (q/k norms: head_dim each) and biases of one decoder layer
    final_norm: int
    num_layers: int
    # a mixture of experts: what its dense-MLP layers differ by from `per_layer` (summed), and the expert
    # weights a token does not run (the experts not routed to it, over all layers)
    dense_layer_adjust: int = 0
    unrouted: int = 0
    # a vision-language model: its vision encoder and projector (kept in 16 bits under QLoRA)
    vision: int = 0

    @property
    def per_layer(self) -> int:
        return self.linear_per_layer + self.other_per_layer

    @property
    def linear(self) -> int:
        """Weights of every projection: what QLoRA quantizes to 4 bits."""
        return self.linear_per_layer * self.num_layers

    @property
    def total(self) -> int:
        per_layers = self.per_layer * self.num_layers + self.dense_layer_adjust
        return self.embedding + self.lm_head + per_layers + self.final_norm + self.vision

    @property
    def active(self) -> int:
        """Parameters a token runs through: all of a dense model; a mixture of experts' top-k experts."""
        return self.total - self.unrouted

    @property
    def kept_16bit(self) -> int:
        """What QLoRA keeps in 16 bits: embeddings, the output layer, norms and biases."""
        return self.total - self.linear

    @property
    def head(self) -> int:
        """The LM head's weights (the embedding's, when tied): V x h, a matmul every token runs."""
        return self.lm_head or self.embedding


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each projection of one decoder layer (one expert's for a MoE MLP), by the names the
    architecture's layers use: Phi's fused qkv_proj (out q + 2 kv) and gate_up_proj (out 2 x intermediate),
    whose LoRA adapters are r x (h + q + 2kv) and r x (h + 2I), not the sum of the separate ones."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    h = m.hidden_size
    i = m.intermediate_size
    if m.num_experts:
        i = m.expert_intermediate_size
    if ARCHITECTURES[m.architecture].fused_projections:
        return {
            "qkv_proj": (h, q + 2 * kv),
            "o_proj": (q, h),
            "gate_up_proj": (h, 2 * i),
            "down_proj": (i, h),
        }
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def count_params(m: ModelConfig) -> ParamCounts:
    shapes = projection_shapes(m)
    attention = sum(d_in * d_out for name, (d_in, d_out) in shapes.items() if name[0] in "qkvo")
    mlp = sum(d_in * d_out for name, (d_in, d_out) in shapes.items() if name[0] not in "qkvo")
    expert = mlp
    arch = ARCHITECTURES[m.architecture]
    # gpt-oss: each expert's gate_up (2I) and down (h) biases, and the router's (one per expert)
    expert_bias = 2 * m.expert_intermediate_size + m.hidden_size if arch.expert_biases else 0
    dense_adjust = unrouted = 0
    if m.num_experts:
        mlp = m.num_experts * expert + m.hidden_size * m.num_experts  # every expert, and the router
        if m.shared_expert_intermediate_size:  # the shared expert's gate/up/down and its h -> 1 gate
            mlp += 3 * m.hidden_size * m.shared_expert_intermediate_size + m.hidden_size
        sparse_layers = m.num_layers - m.dense_layers
        dense_adjust = m.dense_layers * (3 * m.hidden_size * m.intermediate_size - mlp)
        unrouted = sparse_layers * (m.num_experts - m.num_experts_per_token) * (expert + expert_bias)
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    bias = q + 2 * kv + (m.hidden_size if arch.o_proj_bias else 0) if m.attention_bias else 0
    if m.num_experts and arch.expert_biases:
        bias += m.num_experts * (expert_bias + 1)
    norms = (4 if arch.sandwich_norms else 2) * m.hidden_size + (2 * m.head_dim if arch.qk_norm else 0)
    norms += m.num_heads if arch.attention_sinks else 0
    embedding = m.vocab_size * m.hidden_size
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if m.tie_embeddings else embedding,
        linear_per_layer=attention + mlp,
        other_per_layer=norms + bias,
        final_norm=m.hidden_size,
        num_layers=m.num_layers,
        dense_layer_adjust=dense_adjust,
        unrouted=unrouted,
        vision=vision_params(m),
    )


# An encoder projection's (d_in, d_out) by the last part of its name, in the encoder's width d and MLP width f.
_VISION_SHAPES = {
    "qkv": ("d", "3d"),
    "proj": ("d", "d"),
    "q_proj": ("d", "d"),
    "k_proj": ("d", "d"),
    "v_proj": ("d", "d"),
    "out_proj": ("d", "d"),
    "gate_proj": ("d", "f"),
    "up_proj": ("d", "f"),
    "fc1": ("d", "f"),
    "linear_fc1": ("d", "f"),
    "down_proj": ("f", "d"),
    "fc2": ("f", "d"),
    "linear_fc2": ("f", "d"),
}


def vision_layer_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each linear module of one vision encoder layer, by the family's names."""
    tower = ARCHITECTURES[m.architecture].vision
    if tower is None:
        return {}
    size = {"d": m.vision_hidden_size, "3d": 3 * m.vision_hidden_size, "f": m.vision_intermediate_size}
    shapes = {}
    for name in tower.encoder_projections:
        d_in, d_out = _VISION_SHAPES[name.rsplit(".", 1)[-1]]
        shapes[name] = (size[d_in], size[d_out])
    return shapes


def vision_projector_params(m: ModelConfig) -> int:
    """The projector's parameters (and Qwen3-VL's deepstack mergers'), by the family's projector kind."""
    tower = ARCHITECTURES[m.architecture].vision
    if tower is None:
        return 0
    d, h = m.vision_hidden_size, m.hidden_size
    merged = d * m.vision_token_merge
    if tower.projector_kind == "pooled_linear":  # RMSNorm of the width, then one d x h weight
        return d + d * h
    if tower.projector_kind == "merger_mlp":  # a norm, then merged -> merged -> h, biased

        def merger(norm_width: int) -> int:
            norm = 2 * norm_width if tower.layer_norms else norm_width
            return norm + merged * merged + merged + merged * h + h

        return merger(d) + m.vision_deepstack * merger(merged)
    return merged * h  # pixel shuffle, then one unbiased linear


def vision_params(m: ModelConfig) -> int:
    """The vision encoder's and projector's parameters, exactly as transformers builds them (0 without one).

    A patch embedding (a 2-D or, over Qwen-VL's two frames, 3-D convolution, with its bias or not), learned
    positions where the family has them (SigLIP: one a patch of image_size; Qwen3-VL: its table), per layer the
    biased linear layers of `vision_layer_shapes` and two norms (LayerNorm: weight and bias; RMSNorm: weight),
    SigLIP's final LayerNorm, then the projector (`vision_projector_params`)."""
    tower = ARCHITECTURES[m.architecture].vision
    if tower is None:
        return 0
    d, p = m.vision_hidden_size, m.patch_size
    norm = 2 * d if tower.layer_norms else d
    shapes = vision_layer_shapes(m).values()
    per_layer = sum(a * b + b for a, b in shapes) + 2 * norm
    patch = 3 * tower.temporal_patch * p * p * d + (d if tower.patch_bias else 0)
    positions = (m.vision_positions or (m.image_size // p) ** 2) * d if tower.learned_positions else 0
    final = norm if tower.final_norm else 0
    return patch + positions + m.vision_layers * per_layer + final + vision_projector_params(m)


def vision_lora_params(m: ModelConfig, method: MethodConfig) -> int:
    """`method.lora_vision`: r x (d_in + d_out) per encoder projection over its layers, plus the projector
    trained whole (PEFT's modules_to_save: Qwen3-VL's merger, not its deepstack mergers); 0 otherwise."""
    tower = ARCHITECTURES[m.architecture].vision
    if tower is None or not method.lora_vision:
        return 0
    per_layer = sum(method.lora_rank * (a + b) for a, b in vision_layer_shapes(m).values())
    projector = vision_projector_params(replace(m, vision_deepstack=0))
    return m.vision_layers * per_layer + projector


def expert_storage_note(m: ModelConfig) -> Optional[str]:
    """The plan's line for experts a checkpoint stores in a format that does not train (gpt-oss's MXFP4):
    transformers dequantizes them to bf16 when it loads them (its MXFP4 path is inference only, and without the
    `kernels` package it dequantizes anyway); the plan counts the bf16 bytes."""
    bits = ARCHITECTURES[m.architecture].expert_storage_bits
    if not (bits and m.num_experts):
        return None
    experts = (m.num_layers - m.dense_layers) * m.num_experts * 3 * m.hidden_size * m.expert_intermediate_size
    stored, bf16 = experts * bits / 8 / 1e9, 2 * experts / 1e9
    return (
        f"experts: stored as MXFP4 in the checkpoint ({stored:,.1f} GB), which transformers does not train: "
        f"dequantized to bf16 when loaded ({bf16:,.1f} GB, {bf16 - stored:,.1f} GB more; the weights term counts bf16)"
    )


def vision_note(m: ModelConfig, method: MethodConfig) -> Optional[str]:
    """The plan's line for a vision-language model: its image side's weights, what trains there, and the
    image tokens a picture adds to the sequence (the processor's resize and patch rules)."""
    if not ARCHITECTURES[m.architecture].takes_images:
        return None
    trains = "LoRA on the encoder, the projector whole" if method.lora_vision else "frozen"
    if method.spec.trains_base_weights:
        trains = "trained whole"
    crops = f"{m.image_crops} crops x " if m.image_crops > 1 else ""
    return (
        f"images: {m.image_tokens} tokens a picture at {m.image_size} px ({crops}({m.image_size} / "
        f"{m.patch_size})^2 patches / {m.vision_token_merge}), counted in seq_len; vision encoder and projector "
        f"{vision_params(m) / 1e9:,.3f} B parameters ({trains}); the encoder's activations are planned for one "
        f"picture a row (the vision_activations term)"
    )


def check_target_modules(m: ModelConfig, method: MethodConfig) -> None:
    """Every `method.target_modules` name must be a linear module of the architecture's decoder layers."""
    valid = ARCHITECTURES[m.architecture].projections
    unknown = [name for name in method.targets(m.architecture) if name not in valid]
    if unknown:
        raise ConfigError(
            f"method.target_modules has {', '.join(unknown)}, which {m.architecture} layers do not have "
            f"(its linear modules: {', '.join(valid)})"
        )
    if method.lora_experts and not ARCHITECTURES[m.architecture].expert_parameters:
        raise ConfigError(
            f"method.lora_experts=true: {m.architecture} has no fused experts the planner models"
        )


def lora_params(m: ModelConfig, method: MethodConfig) -> int:
    """r x (d_in + d_out) per targeted projection, over all decoder layers."""
    check_target_modules(m, method)
    shapes = projection_shapes(m)
    per_layer = sum(method.lora_rank * sum(shapes[name]) for name in method.targets(m.architecture))
    experts = 0
    if (
        method.lora_experts
    ):  # PEFT: r x E rows of A and columns of B per 3-D weight (gate_up h -> 2I, down I -> h)
        h, i = m.hidden_size, m.expert_intermediate_size
        experts = (m.num_layers - m.dense_layers) * method.lora_rank * m.num_experts * ((h + 2 * i) + (i + h))
    return per_layer * m.num_layers + experts + vision_lora_params(m, method)


__all__ = [
    "LLAMA_PROJECTIONS",
    "ParamCounts",
    "check_target_modules",
    "count_params",
    "expert_storage_note",
    "lora_params",
    "vision_note",
    "vision_params",
]
