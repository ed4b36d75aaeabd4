"""The decoder architectures the planner models, and what each one is made of (pure: stdlib only).

One table for every consumer: the config's validation (`model.architecture`),
the planner's parameter counts and LoRA targets, the config.json reader
(finetune/modeling/models.py, through transformers' AutoConfig) and FSDP's auto-wrap
class (finetune/launch/engines.py). A family is planned only where its decoder
layer is one the activation formulas were measured on
(finetune/planner/activations.py): the Llama layer (RMSNorm, rotary attention
through SDPA, separate q/k/v/o projections, a gated MLP of gate/up/down
projections) and the differences named by the fields below (q/k norms, Gemma's
four norms and fp32 norm product, Phi's fused projections), each measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The seven linear layers of a Llama-style decoder layer, as PEFT names them.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3/4's four: q/k/v in one linear (out: q + 2 kv) and gate/up in one (out: 2 x intermediate).
FUSED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# How a vision-language family's projector maps the encoder's patches into the language model's width.
# `shuffle_linear`: pixel shuffle (merge patches into one vector), then one unbiased linear (Idefics3, SmolVLM).
# `merger_mlp`: a norm of the encoder's width, then two biased linears merged -> merged -> h (Qwen-VL's patch
# merger; Qwen3-VL's deepstack mergers have its shape, their norm over the merged width).
# `pooled_linear`: average pooling to a fixed token count, an RMSNorm and one d x h weight (Gemma 3).
PROJECTORS = ("shuffle_linear", "merger_mlp", "pooled_linear")


@dataclass(frozen=True)
class VisionTower:
    """A vision-language family's image side, as transformers builds it: where its vision encoder, projector
    and language model sit in the module tree, the encoder's linear layers (LoRA's targets where
    `method.lora_vision` adapts it; otherwise it stays frozen), and what else its weights are made of."""

    encoder: str  # the vision encoder's module path
    projector: str  # the projector from the encoder's width into the language model's
    language_model: str  # the text decoder, whose projections LoRA adapts
    encoder_layer: str  # the encoder's layer class (FSDP wraps one unit per layer)
    # an encoder layer's linear modules, by the last parts of their names (all biased)
    encoder_projections: tuple[str, ...]
    text_architecture: str  # the family of its text decoder (a key of ARCHITECTURES, or transformers' name)
    # the encoder's MLP is gated (gate/up/down, three matrices) rather than fc1/fc2 (two)
    gated_mlp: bool = False
    # transformers' processor builds the image placeholders itself (no video processor, so no torchvision)
    processor_without_torchvision: bool = True
    projector_kind: str = "shuffle_linear"  # one of PROJECTORS
    # LayerNorms (weight and bias) in the encoder and projector; False: RMSNorms (weight only)
    layer_norms: bool = True
    # the patch embedding: a convolution over this many frames (Qwen-VL: 2), with a bias or not
    temporal_patch: int = 1
    patch_bias: bool = True
    # learned absolute positions (SigLIP: one a patch; Qwen3-VL: `model.vision_positions`); False: rotary only
    learned_positions: bool = True
    # a LayerNorm after the last encoder layer (SigLIP's post_layernorm)
    final_norm: bool = True


@dataclass(frozen=True)
class Architecture:
    name: str  # transformers' model_type
    decoder_layer: str  # the class FSDP wraps, one unit per layer
    projections: tuple[str, ...]  # a decoder layer's linear modules (PEFT's target_modules)
    attention_bias: bool  # q/k/v biases (Qwen2 has them, its config does not say so)
    mixture_of_experts: bool = False
    # RMSNorm multiplies by (1 + weight) in fp32 (Gemma): a trainable norm keeps its normalized input in fp32
    fp32_norm_product: bool = False
    # RMSNorm of each head's query and key before rotary (Qwen3, Gemma 3)
    qk_norm: bool = False
    # post-attention and post-feedforward norms besides the two pre-norms (Gemma 2 and 3)
    sandwich_norms: bool = False
    # one qkv_proj and one gate_up_proj instead of q/k/v and gate/up (Phi-3/4)
    fused_projections: bool = False
    # A mixture of experts whose sparse layer was measured: its fused 3-D expert weights, as PEFT's
    # `target_parameters` names them (method.lora_experts). Empty: counted, not planned.
    expert_parameters: tuple[str, ...] = ()
    # The router's top-k weights stay fp32 and are always divided by their sum (Mixtral; Qwen-MoE casts them
    # to the compute dtype and renormalizes only where `norm_topk_prob` says): 8k + 4 bytes a token, measured
    fp32_routing_weights: bool = False
    # a learned logit per head that joins every softmax (gpt-oss's attention sinks): H parameters a layer
    attention_sinks: bool = False
    # o_proj has a bias too where the config's attention_bias is set (gpt-oss: all four projections)
    o_proj_bias: bool = False
    # each expert's gate_up and down biases, and the router's (gpt-oss)
    expert_biases: bool = False
    # every other layer, from the first, attends to the last `sliding_window` tokens only (gpt-oss's layer_types)
    sliding_window: int = 0
    # transformers runs the family's attention through SDPA; False: eager, FlexAttention or flash kernels only
    sdpa: bool = True
    # the hub checkpoint stores the experts in this many bits a weight (gpt-oss's MXFP4: 4-bit values and an
    # 8-bit scale per 32, 4.25); transformers' MXFP4 does not train, so training dequantizes them to bf16
    expert_storage_bits: float = 0.0
    # the router takes its top-k logits first and a softmax over those k alone, not over every expert (gpt-oss)
    softmax_after_topk: bool = False
    # gpt-oss's SwiGLU: gate and up clamped, gate x sigmoid(1.702 gate) x (up + 1), each step a saved tensor
    clamped_swiglu: bool = False
    # a vision-language model: its image side (its text decoder is the rest of this entry); None: text only
    vision: Optional[VisionTower] = None

    @property
    def takes_images(self) -> bool:
        return self.vision is not None


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaDecoderLayer", LLAMA_PROJECTIONS, attention_bias=False),
    "mistral": Architecture("mistral", "MistralDecoderLayer", LLAMA_PROJECTIONS, attention_bias=False),
    "qwen2": Architecture("qwen2", "Qwen2DecoderLayer", LLAMA_PROJECTIONS, attention_bias=True),
    "gemma": Architecture(
        "gemma", "GemmaDecoderLayer", LLAMA_PROJECTIONS, attention_bias=False, fp32_norm_product=True
    ),
    # q/k norms (RMSNorm over each head) in every layer; no q/k/v biases
    "qwen3": Architecture("qwen3", "Qwen3DecoderLayer", LLAMA_PROJECTIONS, False, qk_norm=True),
    # Gemma 3's text decoder (the multimodal `gemma3` config's text_config): four norms a layer, q/k norms,
    # (1 + weight) in fp32, sliding-window attention on 5 of 6 layers (the mask's content, not its size)
    "gemma3_text": Architecture(
        "gemma3_text",
        "Gemma3DecoderLayer",
        LLAMA_PROJECTIONS,
        False,
        fp32_norm_product=True,
        qk_norm=True,
        sandwich_norms=True,
    ),  # fmt: skip
    # Phi-3 and Phi-4: fused qkv_proj and gate_up_proj
    "phi3": Architecture("phi3", "Phi3DecoderLayer", FUSED_PROJECTIONS, False, fused_projections=True),
    # Llama attention, and in every layer a router and fused experts ([E, 2I, h] gate_up, [E, h, I] down, I
    # its `intermediate_size`) of which `num_experts_per_tok` run a token: Qwen3-MoE's experts, measured
    "mixtral": Architecture(
        "mixtral",
        "MixtralDecoderLayer",
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        False,
        True,
        expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        fp32_routing_weights=True,
    ),  # fmt: skip
    # Qwen3's attention (q/k norms), a router and fused experts ([E, 2I, h] gate_up, [E, h, I] down) in each
    # sparse layer, dense MLPs where `mlp_only_layers` / `decoder_sparse_step` say (those are not planned)
    "qwen3_moe": Architecture(
        "qwen3_moe",
        "Qwen3MoeDecoderLayer",
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        False,
        True,
        qk_norm=True,
        expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    ),  # fmt: skip
    # gpt-oss: biased q/k/v/o, attention sinks, sliding-window attention (128 tokens) on every other layer,
    # a biased router and fused biased experts ([E, h, 2I] gate_up, [E, I, h] down, I its intermediate_size)
    # stored in MXFP4. No SDPA in transformers: eager on the CPU, FlexAttention on CUDA. RMSNorm multiplies by its
    # weight in fp32, the router's softmax runs over its top-k logits, the SwiGLU is clamped: each measured.
    "gpt_oss": Architecture(
        "gpt_oss",
        "GptOssDecoderLayer",
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        True,
        True,
        expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        attention_sinks=True,
        o_proj_bias=True,
        expert_biases=True,
        sliding_window=128,
        sdpa=False,
        expert_storage_bits=4.25,
        fp32_norm_product=True,
        softmax_after_topk=True,
        clamped_swiglu=True,
    ),  # fmt: skip
    # Qwen2's attention (q/k/v biases) and, besides the routed experts, a shared expert with a sigmoid gate
    "qwen2_moe": Architecture(
        "qwen2_moe", "Qwen2MoeDecoderLayer", ("q_proj", "k_proj", "v_proj", "o_proj"), True, True
    ),
}
# Vision-language families: the text decoder above plus an image side. Idefics3 and SmolVLM: a SigLIP encoder
# (fc1/fc2 MLP), a pixel-shuffle projector and a Llama decoder; Qwen2.5-VL: a windowed ViT with a gated MLP, a
# patch-merger MLP and Qwen2's decoder (q/k/v biases, multimodal rotary positions); Qwen3-VL: a ViT with learned
# positions, a patch merger and deepstack mergers feeding early decoder layers, and Qwen3's decoder (q/k norms);
# Gemma 3: a SigLIP encoder pooled to a fixed token count and Gemma 3's text decoder.
SIGLIP_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
ARCHITECTURES["idefics3"] = Architecture(
    "idefics3",
    "LlamaDecoderLayer",
    LLAMA_PROJECTIONS,
    False,
    vision=VisionTower(
        "model.vision_model",
        "model.connector",
        "model.text_model",
        "Idefics3EncoderLayer",
        SIGLIP_PROJECTIONS,
        "llama",
    ),
)
ARCHITECTURES["smolvlm"] = Architecture(
    "smolvlm",
    "LlamaDecoderLayer",
    LLAMA_PROJECTIONS,
    False,
    vision=VisionTower(
        "model.vision_model",
        "model.connector",
        "model.text_model",
        "SmolVLMEncoderLayer",
        SIGLIP_PROJECTIONS,
        "llama",
        processor_without_torchvision=False,
    ),
)
ARCHITECTURES["qwen2_5_vl"] = Architecture(
    "qwen2_5_vl",
    "Qwen2_5_VLDecoderLayer",
    LLAMA_PROJECTIONS,
    True,
    vision=VisionTower(
        "model.visual",
        "model.visual.merger",
        "model.language_model",
        "Qwen2_5_VLVisionBlock",
        ("qkv", "proj", "gate_proj", "up_proj", "down_proj"),
        "qwen2_5_vl_text",
        gated_mlp=True,
        processor_without_torchvision=False,
        projector_kind="merger_mlp",
        layer_norms=False,
        temporal_patch=2,
        patch_bias=False,
        learned_positions=False,
        final_norm=False,
    ),
)
ARCHITECTURES["qwen3_vl"] = Architecture(
    "qwen3_vl",
    "Qwen3VLTextDecoderLayer",
    LLAMA_PROJECTIONS,
    False,
    qk_norm=True,
    vision=VisionTower(
        "model.visual",
        "model.visual.merger",
        "model.language_model",
        "Qwen3VLVisionBlock",
        # named with their parent, so LoRA's pattern leaves the mergers' linear_fc1/fc2 alone
        ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"),
        "qwen3_vl_text",
        processor_without_torchvision=False,
        projector_kind="merger_mlp",
        temporal_patch=2,
        final_norm=False,
    ),
)
ARCHITECTURES["gemma3"] = Architecture(
    "gemma3",
    "Gemma3DecoderLayer",
    LLAMA_PROJECTIONS,
    False,
    fp32_norm_product=True,
    qk_norm=True,
    sandwich_norms=True,
    vision=VisionTower(
        "model.vision_tower",
        "model.multi_modal_projector",
        "model.language_model",
        "SiglipEncoderLayer",
        SIGLIP_PROJECTIONS,
        "gemma3_text",
        projector_kind="pooled_linear",
    ),
)
PLANNED = tuple(name for name, a in ARCHITECTURES.items() if not a.mixture_of_experts)

# Families a config.json may name that the planner refuses, and why (one line each).
REFUSED: dict[str, str] = {
    "deepseek_v3": "is a mixture of experts with latent attention, which the planner does not model",
    "deepseek_v2": "is a mixture of experts with latent attention, which the planner does not model",
    "gemma2": "has four norms a layer and logit soft-capping, which the activation formulas do not model",
}
# Vision-language families whose image side the planner does not model: their config.json is refused whole,
# in one line, with what is missing where one thing is (empty: the image side as a whole).
REFUSED_VISION: dict[str, str] = {
    "qwen2_vl": "",
    "qwen3_vl_moe": "",
    "idefics2": "",
    "llava": "",
    "mllama": (
        "its language model interleaves cross-attention layers (to every tile's vision tokens, with their own "
        "gates) among the self-attention ones, which the per-layer memory model does not describe"
    ),
}

# Config options whose other values change what a layer computes in ways nothing here measured: a config
# with any of them set otherwise is refused, naming the option (key: (the value the formulas assume, what
# it does)).
UNMODELLED_OPTIONS: dict[str, tuple[object, str]] = {
    "partial_rotary_factor": (1.0, "rotary embeddings on part of each head (Phi-3.5-mini, Phi-4-mini)"),
    "attn_logit_softcapping": (None, "soft-capped attention logits (SDPA cannot run them)"),
    "final_logit_softcapping": (None, "soft-capped output logits"),
    "router_jitter_noise": (0.0, "the router's input scaled by random noise in training (Mixtral's option)"),
}


def unmodelled_option(config: object) -> Optional[str]:
    """The first option of a transformers config set to a value the formulas do not model, as a phrase."""
    for key, (assumed, what) in UNMODELLED_OPTIONS.items():
        value = getattr(config, key, assumed)
        if value != assumed:
            return f"{key}={value!r} ({what}) is not modelled; the planner assumes {assumed!r}"
    return None


def refusal(model_type: str) -> Optional[str]:
    """Why a config.json's `model_type` cannot be planned, or None when it can be read."""
    if model_type in ARCHITECTURES:
        return None
    if model_type in REFUSED:
        return f"{model_type} {REFUSED[model_type]}"
    if model_type in REFUSED_VISION:
        vlms = ", ".join(name for name, a in ARCHITECTURES.items() if a.takes_images)
        why = f": {REFUSED_VISION[model_type]}" if REFUSED_VISION[model_type] else ""
        return (
            f"{model_type} is a vision-language family whose image side the planner does not model{why} "
            f"(modelled: {vlms})"
        )
    return f"model_type {model_type!r} is not one the planner models ({', '.join(PLANNED)})"
