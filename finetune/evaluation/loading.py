"""Loading the models evaluation and export compare: base, trained (base + adapter, or the full model), merged.

The base loads as training loaded it (QLoRA: the NF4 4-bit weights), so `base`
and `trained` differ only by what training changed. Paths come from the run
directory: `adapter/` or `model/` (training), `export/merged/` (export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from finetune import rundir
from finetune.config import Config
from finetune.errors import ConfigError, LaunchError

VARIANTS = ("base", "trained", "merged")


def trained_dir(cfg: Config, run_dir: Path) -> Path:
    return rundir.trained_dir(run_dir, cfg.method.uses_adapters)


def merged_dir(run_dir: Path) -> Path:
    return rundir.merged_dir(run_dir)


def available_variants(cfg: Config, run_dir: Path) -> list[str]:
    """base always; trained once training saved its output; merged once export wrote it."""
    out = ["base"]
    if trained_dir(cfg, run_dir).is_dir():
        out.append("trained")
    if (merged_dir(run_dir) / "config.json").is_file():
        out.append("merged")
    return out


def device_map(cfg: Config) -> Optional[Any]:
    """CUDA: spread over this machine's GPUs; CPU: None (bitsandbytes wants an explicit CPU map)."""
    if cfg.hardware.device == "cuda" and torch.cuda.is_available():
        return "auto"
    return None


def _from_pretrained(source: str, cfg: Config, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            source,
            trust_remote_code=cfg.model.trust_remote_code,
            use_safetensors=None if cfg.model.allow_pickle_weights else True,
            **kwargs,
        )
    except OSError as exc:
        raise ConfigError(f"model: cannot load weights from {source} ({exc})") from None


def load_base(cfg: Config, dtype: torch.dtype, quantized: bool = False, devices: Optional[Any] = None) -> Any:
    """The base model in `dtype`; `quantized`: NF4 4-bit with `dtype` as compute dtype (QLoRA's base)."""
    from finetune.train.models import disable_cpu_bf16_packing, model_source, quantization_config

    source = model_source(cfg.model)
    if not quantized:
        return _from_pretrained(source, cfg, dtype=dtype, device_map=devices)
    model = _from_pretrained(
        source,
        cfg,
        dtype=dtype,
        quantization_config=quantization_config(cfg.method, dtype),
        device_map=devices if devices is not None else {"": "cpu"},
    )
    disable_cpu_bf16_packing(model)
    return model


def attach_adapter(model: Any, adapter: Path) -> Any:
    from peft import PeftModel

    if not (adapter / "adapter_config.json").is_file():
        raise LaunchError(f"{adapter}: no adapter_config.json; run the training stage (mode=train) first")
    peft_model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    check_adapter_matches(peft_model, adapter)
    return peft_model


def check_adapter_matches(peft_model: Any, adapter: Path) -> None:
    """Every saved adapter tensor loaded into a module: PEFT only warns about names it cannot place,
    and an adapter saved under a wrapper's names (FSDP's checkpoint wrapper) would score as the base."""
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    path = adapter / "adapter_model.safetensors"
    if not path.is_file():
        return
    with safe_open(str(path), framework="pt") as f:
        saved = set(f.keys())
    unmatched = sorted(saved - set(get_peft_model_state_dict(peft_model)))
    if unmatched or not saved:
        example = f" (e.g. {unmatched[0]})" if unmatched else ""
        raise LaunchError(
            f"{path}: {len(unmatched)} of {len(saved)} adapter tensors match no module of the model{example}"
        )


def eval_dtype(cfg: Config) -> torch.dtype:
    """Evaluation runs in the training compute dtype (bf16 where native, else fp32)."""
    from finetune.train.models import resolve_dtype

    device = cfg.hardware.device
    name = (
        cfg.method.quant_compute_dtype_on(device)
        if cfg.method.name == "qlora"
        else cfg.method.dtype_on(device)
    )
    key = "method.compute_dtype" if cfg.method.name == "qlora" else "method.precision"
    return resolve_dtype(name, cfg.hardware.device, key=key)


def load_variant(cfg: Config, run_dir: Path, variant: str, base: Optional[Any] = None) -> Any:
    """One of base / trained / merged, ready for `eval()`. `base`: reuse a loaded base for `trained`."""
    dtype, devices = eval_dtype(cfg), device_map(cfg)
    if variant == "base":
        return load_base(cfg, dtype, quantized=cfg.method.name == "qlora", devices=devices)
    if variant == "trained":
        path = trained_dir(cfg, run_dir)
        if cfg.method.uses_adapters:
            if base is None:
                base = load_base(cfg, dtype, quantized=cfg.method.name == "qlora", devices=devices)
            return attach_adapter(base, path)
        if not (path / "config.json").is_file():
            raise LaunchError(f"{path}: no trained model; run the training stage (mode=train) first")
        return _from_pretrained(str(path), cfg, dtype=dtype, device_map=devices)
    if variant == "merged":
        path = merged_dir(run_dir)
        if not (path / "config.json").is_file():
            raise LaunchError(f"{path}: no merged model; run the export stage (mode=export) first")
        if devices is None and "quantization_config" in json.loads((path / "config.json").read_text()):
            devices = {"": "cpu"}  # a lossy 4-bit merge (bitsandbytes wants an explicit CPU map)
        return _from_pretrained(str(path), cfg, dtype=dtype, device_map=devices)
    raise ValueError(f"unknown model variant {variant!r}; one of {', '.join(VARIANTS)}")
