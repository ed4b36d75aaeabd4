"""Schema of the `export` config group: merging the adapter, checking the merge, serving with vLLM, GGUF for
llama.cpp and Ollama, the model card and the Hub."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from finetune.core.config.checks import check_choices, check_positive, choice
from finetune.core.errors import ConfigError

QLORA_MERGE_BASES = ("original", "dequantized")
# export.gguf: llama.cpp's file types. f16, bf16 and q8_0 are written by its converter; q4_k_m by its quantizer
# (llama-cpp-python's llama_model_quantize) from the f16 file.
GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_k_m")

# The merge check's default tolerance on logits, by the dtype the merge ran in: fp32 merges are
# exact to rounding; a bf16 merge rounds W + BA to 8 mantissa bits once, the adapter model does not.
DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.25}


@dataclass
class ExportConfig:
    """`python -m finetune mode=export`: merged weights and/or the adapter, a logits check, serve.sh."""

    # Merge the adapter into the base (merge_and_unload) and save export/merged; false: adapter only.
    merge: bool = True
    # QLoRA: merge into a 16-bit base, never the 4-bit one unless this is set (W + BA re-quantized
    # to NF4 loses most of the update). `qlora_merge_base`: original = the base's own bf16 weights
    # (as the hub ships them); dequantized = the NF4 weights the adapter was trained on, dequantized
    # (the merged model then computes exactly what the trained model computed).
    allow_lossy_4bit_merge: bool = False
    qlora_merge_base: str = choice("original", QLORA_MERGE_BASES)
    # Refuse to merge when the plan's merge_host_memory_gb exceeds this machine's available RAM.
    check_host_memory: bool = True
    max_shard_size: str = "5GB"
    # Merge check: max |logits(merged) - logits(adapter model)| over held-out tokens must stay within
    # the tolerance (None: by merge dtype, DEFAULT_TOLERANCE).
    tolerance: Optional[float] = None
    check_samples: int = 4
    check_max_tokens: int = 256
    # Evaluate the merged model after export and add `merged` to eval/metrics.json.
    evaluate_merged: bool = True
    # serve.sh (vLLM). None: derived (name: the run's name; max_model_len: the trained sequence length;
    # tensor_parallel_size: the fewest GPUs of the hardware profile that hold the weights).
    served_model_name: Optional[str] = None
    max_model_len: Optional[int] = None
    tensor_parallel_size: Optional[int] = None
    gpu_memory_utilization: float = 0.90
    fp8: bool = True  # also write the FP8 variant (--quantization fp8: a merged 70B on one H200)
    serve_dtype: str = choice("bfloat16", ("auto", "bfloat16", "float16"))
    port: int = 8000
    # GGUF of the merged model through llama.cpp's own converter (export/gguf/NAME.TYPE.gguf and an Ollama
    # Modelfile); None: no GGUF.
    gguf: Optional[str] = choice(None, GGUF_TYPES)
    # A llama.cpp checkout (the folder holding convert_hf_to_gguf.py); None: llama.cpp as llama-cpp-python's
    # source release on PyPI ships it, fetched once into $FINETUNE_CACHE/llama.cpp.
    gguf_converter: Optional[str] = None
    # Seconds llama.cpp's converter may run before it is stopped and nothing is exported (a user's checkout is
    # code run as a process: it is fenced like the other user code).
    gguf_timeout_s: float = 3600.0
    # Upload export/ (the merged model, its card and GGUF) to this Hub repository (org/name); None: no upload.
    push_to_hub: Optional[str] = None
    hub_private: bool = True

    def __post_init__(self) -> None:
        check_choices(self, "export")
        if self.push_to_hub is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", self.push_to_hub):
            raise ConfigError(
                f"export.push_to_hub={self.push_to_hub!r} must be a Hub repository id (org/name)"
            )
        if self.tolerance is not None and self.tolerance <= 0:
            raise ConfigError(
                f"export.tolerance={self.tolerance} must be > 0 (or null for the dtype default)"
            )
        for key in ("check_samples", "check_max_tokens", "port"):
            check_positive(f"export.{key}", getattr(self, key))
        for key in ("max_model_len", "tensor_parallel_size"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"export.{key}={value} must be > 0 (or null to derive it)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"export.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if not (math.isfinite(self.gguf_timeout_s) and self.gguf_timeout_s > 0):
            raise ConfigError(
                f"export.gguf_timeout_s={self.gguf_timeout_s} must be a finite number of seconds > 0"
            )
        if not self.max_shard_size.strip():
            raise ConfigError("export.max_shard_size is empty (e.g. 5GB)")

    def tolerance_for(self, dtype: str) -> float:
        return self.tolerance if self.tolerance is not None else DEFAULT_TOLERANCE[dtype]
