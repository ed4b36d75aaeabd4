"""The models a run directory holds, as evaluation and export load them: `base` (the model training
started from), `trained` (its adapter or model) and `merged` (the export), each in the evaluation dtype, with the head the
objective trains (a sequence classifier for a score head: `ObjectiveSpec.head`).

The base loads as training loaded it, so `base` and `trained` differ only by what training changed; under
`init_from=RUN_DIR` the base is that run's output (its adapter on the base, or its model / merged export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import LaunchError
from finetune.modeling.dtypes import eval_dtype
from finetune.modeling.loading import (
    attach_adapter,
    disable_cpu_bf16_packing,
    initial_output,
    load_pretrained,
    quantization_config,
)
from finetune.modeling.models import model_source

if TYPE_CHECKING:
    import torch

# The models a run directory can hold, in the order evaluation compares them.
VARIANTS = ("base", "trained", "merged")


def adapter_on_unchanged_base(cfg: Config) -> bool:
    """The trained adapter sits on the base as it was loaded: with the adapter switched off (or not yet put
    on) the model is the base. Not so under full fine-tuning, nor when the adapter trained is init_from's."""
    return cfg.method.uses_adapters and initial_output(cfg)[0] is None


def trained_dir(cfg: Config, run_dir: Path) -> Path:
    """Where this run's trained output is (RUN_DIR/adapter or RUN_DIR/model)."""
    return rundir.trained_dir(run_dir, cfg.method.uses_adapters)


def available_variants(cfg: Config, run_dir: Path) -> list[str]:
    """base always; trained once training saved its output; merged once export wrote it."""
    out = ["base"]
    if trained_dir(cfg, run_dir).is_dir():
        out.append("trained")
    if (rundir.merged_dir(run_dir) / "config.json").is_file():
        out.append("merged")
    return out


def device_map(cfg: Config) -> Optional[Any]:
    """CUDA: spread over this machine's GPUs; CPU: None (bitsandbytes wants an explicit CPU map)."""
    import torch

    if cfg.hardware.device == "cuda" and torch.cuda.is_available():
        return "auto"
    return None


def base_source(cfg: Config) -> str:
    """Where the weights under the adapters come from: the model's source, or under `init_from` that run's
    fully trained model or merged export (training loaded it instead of the base)."""
    return initial_output(cfg)[1] or model_source(cfg.model)


def load_start(cfg: Config, dtype: torch.dtype, devices: Optional[Any] = None) -> Any:
    """The model training started from, which the evaluation scores as `base`: the base, or under
    `init_from=RUN_DIR` that run's output (its adapter on the base, or its model / merged export), so the report
    says whether this run helped over its starting point (SFT, then DPO)."""
    base = load_base(cfg, dtype, quantized=cfg.method.spec.quantized_base, devices=devices)
    start_adapter = initial_output(cfg)[0]
    return attach_adapter(base, start_adapter) if start_adapter is not None else base


def load_base(cfg: Config, dtype: torch.dtype, quantized: bool = False, devices: Optional[Any] = None) -> Any:
    """The weights under the adapters in `dtype` (`base_source`); `quantized`: NF4 4-bit with `dtype` as compute
    dtype (QLoRA's base)."""
    source = base_source(cfg)
    head = dict(head=cfg.objective.spec.head, seed=cfg.train.seed)  # a score head starts as training's did
    if not quantized:
        return load_pretrained(cfg.model, source, dtype=dtype, device_map=devices, **head)
    model = load_pretrained(
        cfg.model,
        source,
        **head,
        dtype=dtype,
        quantization_config=quantization_config(cfg.method, dtype, model=cfg.model),
        device_map=devices if devices is not None else {"": "cpu"},
    )
    disable_cpu_bf16_packing(model)
    return model


def load_trained_model(cfg: Config, path: Path, **kwargs: Any) -> Any:
    """The fully fine-tuned model training saved (RUN_DIR/model), through the weight-safety check."""
    if not (path / "config.json").is_file():
        raise LaunchError(f"{path}: no trained model; run the training stage (mode=train) first")
    return load_pretrained(cfg.model, str(path), head=cfg.objective.spec.head, **kwargs)


def load_variant(cfg: Config, run_dir: Path, variant: str, base: Optional[Any] = None) -> Any:
    """One of base / trained / merged, ready for `eval()`. `base`: reuse a loaded base for `trained`."""
    dtype, devices = eval_dtype(cfg), device_map(cfg)
    if variant == "base":
        return load_start(cfg, dtype, devices=devices)
    if variant == "trained":
        path = trained_dir(cfg, run_dir)
        if cfg.method.uses_adapters:
            if base is None:
                base = load_base(cfg, dtype, quantized=cfg.method.spec.quantized_base, devices=devices)
            return attach_adapter(base, path)
        return load_trained_model(cfg, path, dtype=dtype, device_map=devices)
    if variant == "merged":
        path = rundir.merged_dir(run_dir)
        if not (path / "config.json").is_file():
            raise LaunchError(f"{path}: no merged model; run the export stage (mode=export) first")
        if devices is None and "quantization_config" in json.loads((path / "config.json").read_text()):
            devices = {"": "cpu"}  # a lossy 4-bit merge (bitsandbytes wants an explicit CPU map)
        return load_pretrained(
            cfg.model, str(path), head=cfg.objective.spec.head, dtype=dtype, device_map=devices
        )
    raise ValueError(f"unknown model variant {variant!r}; one of {', '.join(VARIANTS)}")
