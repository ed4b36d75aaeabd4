"""Reading a model's architecture from its own config.json: the facts the planner plans with.

One path for every model: a local config.json (`model.config_path`, or `model=FOLDER`), a GGUF file
(`model.gguf_file`, converted once into a cached folder, finetune/modeling/gguf.py) or a hub id
(`model=ORG/NAME`: the hub cache, else the hub where reachable) is read through transformers' AutoConfig, so
every key the file leaves out takes the model class's own default, exactly as loading the model would. A
preset (configs/model/) states the same facts offline; given another `model.hub_id` it is checked against
that model's config.json and refused where they differ. The pipeline calls `resolve_model` once; families
the planner does not model are refused with one line (finetune/core/architectures.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from finetune.core import userfiles
from finetune.core.architectures import ARCHITECTURES, REFUSED_VISION, refusal, unmodelled_option
from finetune.core.config import ModelConfig
from finetune.core.errors import ConfigError
from finetune.modeling import gguf
from finetune.planner import count_params


def resolve_model(model: ModelConfig) -> ModelConfig:
    """The architecture facts of a model given by a local config.json or a GGUF file, read from it; other
    models as they are (their config group states them)."""
    if model.gguf_file:
        return model_from_gguf(model)
    if model.config_path:
        return model_from_config_json(model)
    if model.shape == "hub":
        return model_from_hub(model)
    if model.shape == "checked":
        return checked_against_hub(model)
    return model


# The fields that make a model's shape: a preset and its hub id's config.json must agree on each.
SHAPE_FIELDS = (
    "architecture",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_embeddings",
    "num_experts",
    "num_experts_per_token",
    "moe_intermediate_size",
)


def model_from_hub(model: ModelConfig) -> ModelConfig:
    """`model=ORG/NAME`: the architecture from the hub id's config.json (the hub cache, else the hub)."""
    hub_id = model.hub_id or ""
    key = f"model={hub_id}"
    path = hub_config_json(hub_id)
    if path is None:
        raise ConfigError(
            f"{key}: its config.json is neither in the hub cache nor reachable on the hub (offline?); fetch it "
            f"where the hub is reachable (hf download {hub_id} config.json) and pass "
            "model.config_path=PATH/config.json, or run once with the hub reachable"
        )
    return model_from_hf_config(model, _auto_config(model, path, key), key, name=model.name)


def checked_against_hub(model: ModelConfig) -> ModelConfig:
    """A preset given another `model.hub_id`: kept only where that model's config.json has the preset's shape
    (a base and an instruct model of one family); refused where it differs or cannot be read."""
    hub_id = model.hub_id or ""
    key = f"model.hub_id={hub_id}"
    path = hub_config_json(hub_id)
    if path is None:
        raise ConfigError(
            f"{key}: its config.json cannot be read (not in the hub cache, hub unreachable) to check that it has "
            f"model={model.name}'s shape; pass model={hub_id} to plan it by its own config, or "
            "model.config_path=PATH/config.json"
        )
    read = model_from_hf_config(model, _auto_config(model, path, key), key, name=model.name)
    tower = ARCHITECTURES[read.architecture].vision
    if tower is not None and not model.takes_images and tower.text_architecture == model.architecture:
        read = replace(
            read, architecture=model.architecture
        )  # a text preset of an image-text model: its decoder
    differ = [
        f"{f} {getattr(read, f)} not {getattr(model, f)}"
        for f in SHAPE_FIELDS
        if getattr(read, f) != getattr(model, f)
    ]
    if differ:
        raise ConfigError(
            f"{key}: its config.json is not model={model.name}'s shape ({', '.join(differ)}); pass "
            f"model={hub_id} to plan it by its own config"
        )
    return model


def hub_config_json(hub_id: str) -> Optional[Path]:
    """The hub id's config.json: from the hub cache, else downloaded where the hub answers (one quick
    request first, so an offline machine is told at once rather than after the client's retries); None when
    neither."""
    from huggingface_hub import constants, get_session, hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in (
        "1",
        "ON",
        "YES",
        "TRUE",
    ):
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=5)
    except Exception:  # the HTTP client's connection and timeout errors: the hub is unreachable
        return None
    try:
        return Path(hf_hub_download(hub_id, "config.json"))
    except Exception as exc:  # a missing or gated repository: say which
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model={hub_id}: cannot download its config.json ({first})") from None


def model_from_gguf(model: ModelConfig) -> ModelConfig:
    """`model.gguf_file=...`: converted once (finetune/modeling/gguf.py), then read as a config.json is. The
    model keeps the name it was composed with (the config group's, or the file's, `core/composition.py`)."""
    path = gguf.converted_dir(model.gguf_file or "") / "config.json"
    key = f"model.gguf_file={model.gguf_file}"
    return model_from_hf_config(model, _auto_config(model, path, key), key, name=model.name)


def model_from_config_json(model: ModelConfig) -> ModelConfig:
    """`model.config_path=PATH`: architecture facts from a local Hugging Face config.json.

    Read through transformers' AutoConfig, offline, so every key the file leaves out takes the model class's
    own default (Gemma's tied embeddings, a missing max_position_embeddings), exactly as loading the model
    would. The planner then gets a typed ModelConfig; families it does not model are refused here with one
    line (finetune/core/architectures.py). The model is named by its config (`_name_or_path`, else its
    architecture and size), never by the folder the file happens to be in.
    """
    if not model.config_path:
        return model
    path = Path(model.config_path)
    key = f"model.config_path={path}"
    raw = read_config_json(path, key)
    named = raw.get("_name_or_path") if isinstance(raw, dict) else None
    resolved = model_from_hf_config(model, _auto_config(model, path, key), key, name=model.name)
    return replace(resolved, name=_config_name(named, resolved))


def _auto_config(model: ModelConfig, path: Path, key: str) -> Any:
    """The text model's transformers config from a config.json, every failure one line naming the key."""
    from transformers import AutoConfig

    check_config_json(read_config_json(path, key), key)
    try:
        full = AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=model.trust_remote_code
        )
    except Exception as exc:  # a config.json is user input: whatever transformers cannot read is bad input
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{key}: transformers cannot read it ({first[:300]})") from None
    # a vision-language family: the whole config (its text and vision sides); else the text model's
    if full.model_type in REFUSED_VISION:
        raise ConfigError(f"{key}: {refusal(full.model_type)}")
    arch = ARCHITECTURES.get(full.model_type)
    return full if arch is not None and arch.takes_images else full.get_text_config()


# A model's config.json holds a few kilobytes; far more is another file (or a device) named by mistake.
CONFIG_JSON_LIMIT = 16 << 20


def read_config_json(path: Path, key: str) -> Any:
    """A config.json's JSON, read through the one bounded reader of user files (`core/userfiles.py`: a regular
    file of at most CONFIG_JSON_LIMIT bytes); missing, not a file, unreadable, too deeply nested or holding an
    over-long number: one line."""
    if not path.exists():
        raise ConfigError(f"{key}: no such file")
    text = userfiles.read_text(path, key.partition("=")[0], limit=CONFIG_JSON_LIMIT)
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{key}: nested too deeply to be a model's config.json") from None
    except ValueError as exc:
        raise ConfigError(f"{key}: not a readable JSON file ({str(exc)[:200]})") from None


# The sizes a config.json states, each a positive whole number where present (`text_config` too).
_SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
_FLOAT_KEYS = ("rope_theta", "rms_norm_eps")
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob")
# Larger than any model's dimension: a value beyond it is a typo, not a model (and would overflow the counts).
_MAX_SIZE = 10**9


def check_config_json(raw: Any, key: str) -> None:
    """The types transformers' own config classes would reject with a traceback, refused in one line that
    names the field: a size that is not a positive whole number, a float field that is not a finite number,
    a flag that is not true or false."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: not a model's config.json (a JSON object of its settings)")
    sections = [("", raw)]
    if isinstance(raw.get("text_config"), dict):
        sections.append(("text_config.", raw["text_config"]))
    for prefix, section in sections:
        for name in _SIZE_KEYS:
            value = section.get(name, 1)
            if name in ("num_experts", "num_local_experts", "shared_expert_intermediate_size") and value in (
                0,
                None,
            ):
                continue
            if name in ("head_dim", "num_key_value_heads") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_SIZE:
                raise ConfigError(
                    f"{key}: {prefix}{name}={_shown(value)} must be a whole number in 1..{_MAX_SIZE:,}"
                )
        for name in _FLOAT_KEYS:
            value = section.get(name, 1.0)
            if name in section and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{key}: {prefix}{name}={_shown(value)} must be a finite number")
        for name in _BOOL_KEYS:
            if not isinstance(section.get(name, False), bool):
                raise ConfigError(f"{key}: {prefix}{name}={_shown(section[name])} must be true or false")


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"


def model_from_hf_config(model: ModelConfig, hf: Any, key: str, name: str) -> ModelConfig:
    """The ModelConfig of a transformers config object (its class defaults included); `key` names the source
    in errors."""
    model_type, full = hf.model_type, hf
    if ARCHITECTURES.get(model_type) is not None and ARCHITECTURES[model_type].takes_images:
        hf = hf.get_text_config()  # the text decoder's facts; the vision side is read below
    experts = int(getattr(hf, "num_local_experts", 0) or getattr(hf, "num_experts", 0) or 0)
    why = refusal(model_type) or unmodelled_option(hf)
    if why is not None:
        raise ConfigError(f"{key}: {why}")
    arch = ARCHITECTURES[model_type]
    heads = int(hf.num_attention_heads)
    hidden = int(hf.hidden_size)
    rope = getattr(hf, "rope_parameters", None) or {}
    try:
        read = replace(
            model,
            name=name,
            architecture=model_type,
            hidden_size=hidden,
            num_layers=int(hf.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf, "head_dim", None) or hidden // heads),
            intermediate_size=int(hf.intermediate_size),
            vocab_size=int(hf.vocab_size),
            tie_embeddings=bool(
                getattr(hf, "tie_word_embeddings", None) or getattr(full, "tie_word_embeddings", False)
            ),
            attention_bias=bool(getattr(hf, "attention_bias", arch.attention_bias) or arch.attention_bias),
            max_position_embeddings=int(hf.max_position_embeddings),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", model.rope_theta))),
            rms_norm_eps=float(getattr(hf, "rms_norm_eps", model.rms_norm_eps)),
            num_experts=experts,
            num_experts_per_token=int(getattr(hf, "num_experts_per_tok", 0) or 0) if experts else 0,
            moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", 0) or 0) if experts else 0,
            dense_layers=_dense_layers(hf, experts),
            shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)) if experts else False,
            hub_id=model.hub_id,
            **_vision_fields(model, full, key),
        )
    except (AttributeError, TypeError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    return read


def _vision_fields(model: ModelConfig, full: Any, key: str) -> dict[str, Any]:
    """A vision-language config's image side: the encoder's sizes (SigLIP's keys, or Qwen-VL's `depth` and
    `num_heads`), how many patches become one token (Idefics3/SmolVLM: `scale_factor` squared; Qwen-VL:
    `spatial_merge_size` squared; Gemma 3: its patches over `mm_tokens_per_image`), the crops a tiling
    processor makes of a square picture (SmolVLM: `size` over `max_image_size`), Qwen3-VL's position table and
    deepstack mergers. Qwen-VL has no fixed image size: `model.image_size` or 448 pixels, its processor
    resizing any picture to about that many patches."""
    if not ARCHITECTURES[full.model_type].takes_images:
        return {}
    vc = full.vision_config
    try:
        patch = int(vc.patch_size)
        image_size = int(getattr(vc, "image_size", 0) or model.image_size or 448)
        merge = int(getattr(vc, "spatial_merge_size", 0) or getattr(full, "scale_factor", 0) or 1) ** 2
        if getattr(full, "mm_tokens_per_image", None):
            merge = (image_size // patch) ** 2 // int(full.mm_tokens_per_image)
        return dict(
            vision_hidden_size=int(vc.hidden_size),
            vision_layers=int(getattr(vc, "depth", None) or vc.num_hidden_layers),
            vision_heads=int(getattr(vc, "num_heads", None) or vc.num_attention_heads),
            vision_intermediate_size=int(vc.intermediate_size),
            patch_size=patch,
            image_size=image_size,
            vision_token_merge=merge,
            image_crops=_image_crops(vc),
            vision_positions=int(getattr(vc, "num_position_embeddings", 0) or 0),
            vision_deepstack=len(getattr(vc, "deepstack_visual_indexes", None) or ()),
        )
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"{key}: vision_config: {exc}") from None


def _image_crops(vc: Any) -> int:
    """The pictures a tiling processor (SmolVLM's) gives the encoder for one square image: resized to `size`'s
    longest edge, cut into `max_image_size` squares, plus the whole picture at that size; 1 without tiling."""
    size, tile = getattr(vc, "size", None), getattr(vc, "max_image_size", None)
    if not (isinstance(size, dict) and isinstance(tile, dict)):
        return 1
    per_side = math.ceil(int(size["longest_edge"]) / int(tile["longest_edge"]))
    return per_side**2 + 1 if per_side > 1 else 1


def _dense_layers(hf: Any, experts: int) -> int:
    """How many layers of a mixture of experts have a dense MLP, by the rule Qwen-MoE's layers apply
    (not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`: sparse); Mixtral has neither key."""
    if not experts:
        return 0
    only = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    layers = int(hf.num_hidden_layers)
    return sum(1 for i in range(layers) if i in only or (i + 1) % step)


def _config_name(named: Any, model: ModelConfig) -> str:
    """A config.json's own name when it records one (a hub id, not a path), else `<architecture>-<size>`
    (llama-70.6B): what the plan and the reports call the model."""
    if (
        isinstance(named, str)
        and named.strip()
        and not Path(named).is_absolute()
        and not named.startswith(".")
    ):
        return named.strip()
    total = count_params(model).total
    size = f"{total / 1e9:.1f}B" if total >= 1e9 else f"{total / 1e6:.0f}M"
    return f"{model.architecture}-{size}"
