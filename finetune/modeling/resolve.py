"""Reading a model's architecture from its own config.json: the facts the planner plans with.

A model given by a local config.json (`model.config_path`) or a GGUF file (`model.gguf_file`, converted once
into a cached folder, finetune/modeling/gguf.py) is read through transformers' AutoConfig, so every key the
file leaves out takes the model class's own default, exactly as loading the model would. The pipeline calls
`resolve_model` once; families the planner does not model are refused with one line
(finetune/core/architectures.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from finetune.core.architectures import ARCHITECTURES, refusal, unmodelled_option
from finetune.core.config import ModelConfig
from finetune.core.errors import ConfigError
from finetune.modeling import gguf
from finetune.planner import count_params


def resolve_model(model: ModelConfig) -> ModelConfig:
    """The architecture facts of a model given by a local config.json or a GGUF file, read from it; other
    models as they are (their config group states them)."""
    if model.gguf_file:
        return model_from_gguf(model)
    return model_from_config_json(model)


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
    if not path.is_file():
        raise ConfigError(f"{key}: no such file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{key}: not a readable JSON file ({exc})") from None
    named = raw.get("_name_or_path") if isinstance(raw, dict) else None
    resolved = model_from_hf_config(model, _auto_config(model, path, key), key, name=model.name)
    return replace(resolved, name=_config_name(named, resolved))


def _auto_config(model: ModelConfig, path: Path, key: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=model.trust_remote_code
        ).get_text_config()
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{key}: transformers cannot read it ({first})") from None


def model_from_hf_config(model: ModelConfig, hf: Any, key: str, name: str) -> ModelConfig:
    """The ModelConfig of a transformers config object (its class defaults included); `key` names the source
    in errors."""
    model_type = hf.model_type
    experts = int(getattr(hf, "num_local_experts", 0) or getattr(hf, "num_experts", 0) or 0)
    why = refusal(model_type) or unmodelled_option(hf)
    if why is not None:
        raise ConfigError(f"{key}: {why}")
    arch = ARCHITECTURES[model_type]
    heads = int(hf.num_attention_heads)
    hidden = int(hf.hidden_size)
    rope = getattr(hf, "rope_parameters", None) or {}
    try:
        return replace(
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
            tie_embeddings=bool(hf.tie_word_embeddings),
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
        )
    except (AttributeError, TypeError) as exc:
        raise ConfigError(f"{key}: {exc}") from None


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
