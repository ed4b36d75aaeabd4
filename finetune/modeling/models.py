"""Which model a run names and where it loads from: the tiny model built locally, a local folder (a
`model.config_path`, or a GGUF file converted once into a cached safetensors folder, finetune/modeling/gguf.py),
or a hub id; its tokenizer (`load_tokenizer`, what the data stage renders with and every stage uses). The
architecture facts of a config.json or GGUF file are read once by the pipeline (`resolve.resolve_model`,
finetune/modeling/resolve.py).

Loading the weights: `finetune.modeling.loading` (as a method trains them), `finetune.modeling.variants`
(base, trained and merged, as evaluation and export score them), in the dtype of `finetune.modeling.dtypes`.

transformers is imported inside the functions: the pipeline imports this module on `mode=plan`'s path,
which loads none of the heavy libraries.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config import ModelConfig
from finetune.core.errors import ConfigError, DataError
from finetune.modeling import gguf, tiny, tiny_vlm

# ---------------------------------------------------------------- which model, from where


def is_tiny(model: ModelConfig) -> bool:
    """The embedded default's model, built locally (`finetune.modeling.tiny`): no hub id, config.json or GGUF."""
    return model.name == "tiny" and not model.hub_id and not model.config_path and not model.gguf_file


def local_folder(model: ModelConfig) -> Optional[Path]:
    """The local folder the weights and tokenizer load from: a GGUF file's converted folder (built on first
    use), or the folder of `model.config_path`; None for a hub id or the tiny model."""
    if model.gguf_file:
        return gguf.converted_dir(model.gguf_file)
    if model.config_path:
        return Path(model.config_path).parent
    return None


def model_source(model: ModelConfig) -> str:
    """What `from_pretrained` loads: the tiny model's folder (built on first use), a local folder, or a hub id."""
    if is_tiny(model):
        return str(tiny_vlm.model_dir(model) if model.takes_images else tiny.model_dir(model))
    folder = local_folder(model)
    if folder is not None:
        return str(folder)
    if model.hub_id:
        return model.hub_id
    raise ConfigError(f"model.hub_id is not set for model={model.name}: nothing to load the weights from")


def load_processor(source: str, trust_remote_code: bool = False) -> Any:
    """A vision-language model's own processor (its image rules, tokenizer and chat template)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer whose chat template renders the data: the tiny one built locally, else the model's own;
    for a model that takes images, its processor (its image rules, tokenizer and chat template)."""
    if model.takes_images:
        tower = ARCHITECTURES[model.architecture].vision
        if (
            tower is not None
            and not tower.processor_without_torchvision
            and importlib.util.find_spec("torchvision") is None
        ):
            raise ConfigError(
                f"model.architecture={model.architecture}: its processor needs torchvision, which is not "
                "installed (pip install '.[vision]', torchvision built for the installed torch)"
            )
        return load_processor(model_source(model), trust_remote_code=model.trust_remote_code)
    if is_tiny(model):
        return tiny.load_tokenizer(model)
    folder = local_folder(model)
    source = str(folder) if folder is not None else model.hub_id
    if not source:
        raise ConfigError(
            f"model.hub_id is not set for model={model.name}: the data stage needs its tokenizer"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"model.hub_id={source}: cannot load the tokenizer ({first})") from None
    if tok.pad_token is None:
        # Llama 3.x and others ship no pad token; pad with eos as TRL's SFTTrainer does (padding is masked
        # out of attention and loss, so which id fills it does not matter, only that one exists).
        if tok.eos_token is None:
            raise DataError(
                f"model.hub_id={source}: the tokenizer has neither a pad nor an eos token to pad with"
            )
        tok.pad_token = tok.eos_token
    return tok
