"""Merging the adapter into a 16-bit base, and proving the merge changed nothing.

LoRA: the base loads in the merge dtype (`method.dtype_on(hardware.device)`: bf16
on GPU machines, fp32 on the CPU), the adapter goes on top, `merge_and_unload()`
folds W + (alpha/r)·BA into each weight. QLoRA: the same on a 16-bit base (the
original weights, or the NF4 weights dequantized), never the 4-bit one unless
`export.allow_lossy_4bit_merge` (re-quantizing W + BA to NF4 drops most of a
small update). The check runs held-out inputs through the adapter model before
merging and the merged model after, and compares the logits token by token.
Everything runs on the CPU, in host RAM (the plan's `merge_host_memory_gb`).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from finetune.core.config import Config
from finetune.core.errors import FinetuneError
from finetune.modeling.loading import attach_adapter
from finetune.modeling.variants import load_base, load_trained_model, trained_dir

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ExportError(FinetuneError):
    """The merge cannot run here (host RAM), or its result does not match the adapter model."""


def merge_dtype(cfg: Config) -> str:
    """bf16 on GPU machines, fp32 on the CPU (`method.precision` decides when it is not auto)."""
    return cfg.method.dtype_on(cfg.hardware.device)


def check_host_memory(needed_gb: float, available_gb: Optional[float] = None) -> float:
    """Raise unless this machine's available RAM holds the plan's merge footprint; returns the available GB."""
    if available_gb is None:
        import psutil

        available_gb = psutil.virtual_memory().available / 1e9
    if needed_gb > available_gb:
        raise ExportError(
            f"merging needs {needed_gb:.1f} GB of host RAM for the 16-bit base (plan.json merge_host_memory_gb), "
            f"this machine has {available_gb:.1f} GB available: run mode=export on a larger machine, "
            "or set export.merge=false to ship the adapter alone (serve.sh lora)"
        )
    return available_gb


def check_inputs(
    eval_dataset: Any, tokenizer: Any, samples: int, max_tokens: int, fallback: list
) -> list[torch.Tensor]:
    """Token ids of held-out conversations (the data stage's eval split), or of `fallback` conversations."""
    rows: list[list[int]] = []
    columns = eval_dataset.column_names if eval_dataset is not None and len(eval_dataset) else []
    if "input_ids" in columns:
        rows = [list(eval_dataset[i]["input_ids"]) for i in range(min(samples, len(eval_dataset)))]
    else:
        # GRPO's held-out rows are prompts with the conversation as JSON text, not token ids
        # a vision-language model's rows hold images: the check compares the text path on `fallback`
        if "messages" in columns and "images" not in columns:
            fallback = [
                json.loads(eval_dataset[i]["messages"]) for i in range(min(samples, len(eval_dataset)))
            ]
        processor = hasattr(tokenizer, "image_processor")  # a VLM's processor renders a batch
        for messages in fallback[:samples]:
            ids = tokenizer.apply_chat_template(
                [messages] if processor else messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
            rows.append(list(ids[0] if processor else ids))
    if not rows:
        raise ExportError("the merge check has no inputs: run the data stage (mode=data) first")
    return [torch.tensor(r[:max_tokens], dtype=torch.long) for r in rows]


@torch.no_grad()
def logits_on(model: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 logits of each input, one sequence at a time (no padding to get wrong)."""
    model.eval()
    device = next(model.parameters()).device
    return [model(input_ids=x[None].to(device), use_cache=False).logits[0].float().cpu() for x in inputs]


def compare_logits(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> dict[str, Any]:
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(reference, candidate)])
    # a score head's one value a sequence compares as one token
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).reshape(-1) for a, b in zip(reference, candidate)])
    return {
        "max_abs_diff": float(diffs.max()),
        "mean_abs_diff": float(diffs.mean()),
        "top1_agreement": float(agree.float().mean()),
        "tokens": int(agree.numel()),
        "sequences": len(reference),
        "reference_logit_scale": float(torch.cat([r.flatten() for r in reference]).abs().max()),
    }


def merged_model(cfg: Config, run_dir: Path, inputs: list[torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    """The model to ship (adapters merged, or the fully fine-tuned model cast), and the check's numbers."""
    x = cfg.export
    dtype_name = merge_dtype(cfg)
    dtype = _DTYPES[dtype_name]
    info: dict[str, Any] = {"method": cfg.method.name, "dtype": dtype_name}

    merge_kind = cfg.method.spec.merge  # finetune/core/methods.py: MERGES
    if merge_kind == "cast":
        path = trained_dir(cfg, run_dir)
        model = load_trained_model(cfg, path, dtype="auto")
        reference = logits_on(model, inputs)
        model.to(dtype)  # in place
        info["reference"] = f"the trained model as saved ({path.name}/)"
        return model, {**info, **compare_logits(reference, logits_on(model, inputs))}

    adapter = trained_dir(cfg, run_dir)
    if merge_kind == "adapter_quantized_base" and x.allow_lossy_4bit_merge:
        log.warning(
            "export.allow_lossy_4bit_merge=true: merging into the 4-bit NF4 base re-quantizes W + BA "
            "and loses most of the update; the merge check will show how much"
        )
        compute = (
            _DTYPES[cfg.method.quant_compute_dtype_on(cfg.hardware.device)]
            if dtype_name == "bf16"
            else torch.float32
        )
        base = load_base(cfg, compute, quantized=True)
        info.update(base="nf4 (lossy)", dtype="nf4")
    elif merge_kind == "adapter_quantized_base" and x.qlora_merge_base == "dequantized":
        base = load_base(cfg, dtype, quantized=True)
        base.dequantize()
        info["base"] = "nf4 dequantized"
    else:
        base = load_base(cfg, dtype, quantized=False)
        info["base"] = "original"
    model = attach_adapter(base, adapter)
    reference = logits_on(model, inputs)
    info["reference"] = f"the adapter on the same {info['base']} base, before merging"
    with warnings.catch_warnings():
        # PEFT's own note on merging into 4-bit; the lossy path is opted into and already logged above.
        warnings.filterwarnings("ignore", message="Merge lora module to 4-bit linear")
        merged = model.merge_and_unload()
    return merged, {**info, **compare_logits(reference, logits_on(merged, inputs))}


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def save_model(model: Any, tokenizer: Any, out: Path, max_shard_size: str) -> dict[str, Any]:
    """safetensors shards, tokenizer and generation config into `out`, a new folder (the export stage
    writes the whole export into a staging folder and renames it into place: `outputs.staged`)."""
    from transformers import GenerationConfig

    if getattr(model, "generation_config", None) is None:
        model.generation_config = GenerationConfig()
    gen = model.generation_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, key, None) is None and getattr(tokenizer, key, None) is not None:
            setattr(gen, key, getattr(tokenizer, key))
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(out))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    return {"path": str(out), "size_bytes": dir_size(out), "shards": shards}
