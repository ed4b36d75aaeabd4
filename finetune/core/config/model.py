"""Schema of the `model` config group: the architecture facts the planner counts with."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config.checks import DATA_KEY, check_choices, check_positive, choice
from finetune.core.errors import ConfigError

# `model.gguf_file=package:NAME/FILE`: FILE inside the installed package NAME (found without importing it).
GGUF_PACKAGE_PREFIX = "package:"
_PACKAGE_SPEC = re.compile(r"package:([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)/(.+)")

SHAPE_SOURCES = ("stated", "hub", "checked")


def check_gguf_spec(spec: str) -> None:
    """A path, or package:NAME/FILE with NAME an importable name and FILE inside it (no '..')."""
    if not spec.strip():
        raise ConfigError("model.gguf_file is empty: give a path or package:NAME/FILE")
    if spec.startswith(GGUF_PACKAGE_PREFIX):
        m = _PACKAGE_SPEC.fullmatch(spec)
        if not m or ".." in Path(m.group(2)).parts or Path(m.group(2)).is_absolute():
            raise ConfigError(
                f"model.gguf_file={spec}: write package:NAME/FILE (NAME an installed Python package, FILE a "
                "path inside it)"
            )


def gguf_package_spec(spec: str) -> Optional[tuple[str, str]]:
    """(package, file inside it) of package:NAME/FILE; None for a plain path."""
    m = _PACKAGE_SPEC.fullmatch(spec)
    return (m.group(1), m.group(2)) if m else None


@dataclass
class ModelConfig:
    """Architecture facts, so the planner works offline. `config_path` reads a local config.json instead
    (through transformers' AutoConfig: the model class's own defaults fill what the file leaves out);
    `gguf_file` takes the model, its tokenizer and chat template from a GGUF file (finetune/modeling/gguf.py)."""

    name: str = "tiny"
    hub_id: Optional[str] = None
    # Where the architecture facts below come from. `stated`: this config group states them (a preset is an
    # offline copy of its model's config.json). `hub`: read from hub_id's config.json (the hub cache, or the
    # hub where reachable): what `model=ORG/NAME` composes. `checked`: stated, and hub_id's config.json must
    # agree: a preset given another model.hub_id is refused rather than planned as the preset.
    shape: str = choice("stated", SHAPE_SOURCES)
    config_path: Optional[str] = None
    # A GGUF file (llama.cpp, Ollama): a path, or package:NAME/FILE for a file an installed package ships.
    # Converted once into a safetensors folder in the cache (keyed by the file's hash); it wins over hub_id.
    gguf_file: Optional[str] = None
    # A family of finetune/core/architectures.py (mixtures of experts: those with `expert_parameters`).
    architecture: str = choice("llama", ARCHITECTURES)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 172
    vocab_size: int = 512
    tie_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = field(default=2048, metadata=DATA_KEY)
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    # Mixture of experts (0: dense): experts per layer, how many run per token, each expert's MLP width.
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # Layers whose MLP is dense (intermediate_size wide) among a mixture of experts' layers (Qwen-MoE's
    # `mlp_only_layers` and `decoder_sparse_step`, as its layers read them), and a shared expert's width
    # (Qwen2-MoE's always-on expert, with its sigmoid gate; 0: none).
    dense_layers: int = 0
    shared_expert_intermediate_size: int = 0
    # The router divides its top-k weights by their sum (Qwen-MoE's `norm_topk_prob`; Mixtral always does).
    norm_topk_prob: bool = False
    # A vision-language family's image side (0: none). The encoder's width, layers, heads and MLP width.
    vision_hidden_size: int = 0
    vision_layers: int = 0
    vision_heads: int = 0
    vision_intermediate_size: int = 0
    # The encoder's patch side in pixels; the image side the processor resizes to (pixels, the longest
    # edge); how many encoder patches merge into one language-model token (Idefics3's scale_factor squared,
    # Qwen2.5-VL's spatial_merge_size squared; Gemma 3: the patches over its mm_tokens_per_image). Image tokens
    # per image: image_crops x (image_size / patch_size)^2 / merge.
    patch_size: int = 14
    image_size: int = 0
    vision_token_merge: int = 4
    # The pictures the encoder sees for one image: 1, or a processor that tiles each image into crops of
    # image_size plus one downscaled whole view (SmolVLM: its `size` over its `max_image_size`, squared, + 1).
    image_crops: int = 1
    # An encoder's learned position table where it is not one entry a patch of image_size (Qwen3-VL's
    # `num_position_embeddings`, interpolated to each picture's grid; 0: (image_size / patch_size)^2 or none),
    # and Qwen3-VL's deepstack mergers (one per `deepstack_visual_indexes` entry, each the merger's shape).
    vision_positions: int = 0
    vision_deepstack: int = 0
    # Weights: safetensors only unless this is set (pickle files can run code).
    allow_pickle_weights: bool = False
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        check_choices(self, "model")
        if self.shape != "stated" and not self.hub_id:
            raise ConfigError(f"model.shape={self.shape} reads hub_id's config.json: set model.hub_id")
        if self.gguf_file is not None:
            check_gguf_spec(self.gguf_file)
            if self.config_path:
                raise ConfigError(
                    "model.gguf_file and model.config_path are both set: the GGUF file holds the config; "
                    "choose one"
                )
        for key in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            check_positive(f"model.{key}", getattr(self, key))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        fused = ARCHITECTURES[self.architecture].fused_projections
        if fused and self.num_heads * self.head_dim != self.hidden_size:
            raise ConfigError(
                f"model.head_dim={self.head_dim} x model.num_heads={self.num_heads} must equal "
                f"model.hidden_size={self.hidden_size} for {self.architecture} (its head_dim is hidden / heads)"
            )
        if self.takes_images:
            for key in ("vision_hidden_size", "vision_layers", "vision_heads", "vision_intermediate_size"):
                check_positive(f"model.{key}", getattr(self, key))
            for key in ("patch_size", "image_size", "vision_token_merge", "image_crops"):
                check_positive(f"model.{key}", getattr(self, key))
            for key in ("vision_positions", "vision_deepstack"):
                check_positive(f"model.{key}", getattr(self, key), allow_zero=True)
            if self.image_size % self.patch_size:
                raise ConfigError(
                    f"model.image_size={self.image_size} must be a multiple of model.patch_size={self.patch_size}"
                )
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(
                f"model.num_experts_per_token={self.num_experts_per_token} must be in 1..{self.num_experts} "
                "(model.num_experts)"
            )

    @property
    def takes_images(self) -> bool:
        """A vision-language family (finetune/core/architectures.py's `vision`): its data carry images."""
        return ARCHITECTURES[self.architecture].takes_images

    @property
    def image_tokens(self) -> int:
        """Language-model tokens one image becomes, from the processor's resize and patch rules; 0 without images."""
        if not self.takes_images:
            return 0
        patches = (self.image_size // self.patch_size) ** 2
        return self.image_crops * (patches // self.vision_token_merge)

    @property
    def expert_intermediate_size(self) -> int:
        """One expert's MLP width: Qwen-MoE's `moe_intermediate_size`, Mixtral's `intermediate_size`."""
        return self.moe_intermediate_size or self.intermediate_size
