"""Model loading per method: full, LoRA (PEFT) or QLoRA (bitsandbytes NF4 + PEFT).

One path for every model: `from_pretrained(source)`, where the source is the
hub id, the folder of a local `config.json`, or the folder the tiny model was
built into (`finetune.tiny.model_dir`). Weights load from safetensors only,
unless `model.allow_pickle_weights` is set.

Precision: `method.precision` (`auto`: bf16 on GPUs, fp32 on the CPU); bf16
is used where the device runs it natively (CUDA with bf16, CPUs with
AVX512-BF16 or AMX), elsewhere training falls back to fp32 and says so. Full fine-tuning keeps fp32 master weights under bf16
autocast; LoRA freezes the base in the compute dtype and keeps the adapters in
`method.adapter_dtype`; QLoRA stores the frozen linear weights in 4 bits.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from finetune.config import Config, MethodConfig, ModelConfig
from finetune.errors import ConfigError
from finetune.train.throughput import attn_implementation

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (elsewhere they are emulated and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_supported(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def resolve_dtype(name: str, device: str, key: str = "method.precision") -> torch.dtype:
    """The torch dtype for `bf16`/`fp32`.

    bf16 on a CPU without AVX512-BF16 or AMX is kept (emulated, slow): tests use it to run the dtypes a
    GPU runs. A GPU without bf16 (before Ampere) falls back to fp32, with a log line.
    """
    dtype = _DTYPES[name]
    if dtype == torch.bfloat16 and not bf16_supported(device):
        if device == "cpu":
            log.warning("%s=bf16 is emulated on this CPU (no AVX512-BF16 or AMX): slow", key)
            return dtype
        log.warning("%s=bf16 is not supported by this GPU: training in fp32", key)
        return torch.float32
    return dtype


def is_tiny(model: ModelConfig) -> bool:
    return model.name == "tiny" and not model.hub_id and not model.config_path


def model_source(model: ModelConfig) -> str:
    """What `from_pretrained` loads: the tiny model's folder (built on first use), a local folder, or a hub id."""
    if is_tiny(model):
        from finetune import tiny

        return str(tiny.model_dir(model))
    if model.hub_id:
        return model.hub_id
    if model.config_path:
        return str(Path(model.config_path).parent)
    raise ConfigError(f"model.hub_id is not set for model={model.name}: nothing to load the weights from")


def load_tokenizer(model: ModelConfig) -> Any:
    """The same tokenizer the data stage rendered with."""
    from finetune.data.stage import load_tokenizer as data_tokenizer

    return data_tokenizer(model)


def quantization_config(method: MethodConfig, compute_dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=method.quant_type,
        bnb_4bit_use_double_quant=method.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def disable_cpu_bf16_packing(model: torch.nn.Module) -> int:
    """Keep bitsandbytes' Linear4bit in its trainable layout on CPUs with AVX512-BF16.

    There, any forward in eval mode without grad (evaluation, generation) silently
    repacks the 4-bit weight into an inference-only layout, and LoRA gradients
    computed afterwards are wrong. Returns the number of layers switched off.
    """
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def lora_config(method: MethodConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=method.lora_rank,
        lora_alpha=method.lora_alpha,
        lora_dropout=method.lora_dropout,
        target_modules=list(method.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _device_map(cfg: Config) -> Any:
    """QLoRA places the quantized weights at load time: this rank's GPU, or the CPU."""
    if cfg.hardware.device == "cuda" and torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", "0"))}
    return {"": "cpu"}


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weight_safety(model: ModelConfig, source: str) -> None:
    """Refuse pickle-only weights unless `model.allow_pickle_weights`; log every opt-in that can run code.

    Pickle files (pytorch_model.bin, *.pt) execute code when loaded; safetensors cannot.
    `trust_remote_code` runs the Python that ships with a hub model. Both stay off unless set.
    """
    if model.trust_remote_code:
        log.warning("model.trust_remote_code=true: running the model's own Python code from %s", source)
    folder = Path(source)
    if not folder.is_dir():
        if model.allow_pickle_weights:
            log.warning("model.allow_pickle_weights=true: pickle weights from %s may be loaded", source)
        return
    files = [p.name for p in folder.iterdir() if p.is_file()]
    pickles = sorted(n for n in files if n.endswith(_PICKLE_SUFFIXES) and n != "training_args.bin")
    if any(n.endswith(".safetensors") for n in files) or not pickles:
        return
    if not model.allow_pickle_weights:
        raise ConfigError(
            f"model: {source} has only pickle weights ({pickles[0]}), which can run code when loaded; convert "
            "them to safetensors, or set model.allow_pickle_weights=true if you trust their source"
        )
    log.warning("model.allow_pickle_weights=true: loading pickle weights %s from %s", pickles[0], source)


def training_dtype(cfg: Config) -> torch.dtype:
    """The compute dtype (bf16 or fp32) the run trains in."""
    return resolve_dtype(cfg.method.dtype_on(cfg.hardware.device), cfg.hardware.device)


def load_for_training(cfg: Config) -> tuple[Any, torch.dtype]:
    """The model ready to train with `cfg.method`, and the compute dtype (bf16 or fp32) to train it in.

    Under DeepSpeed ZeRO-3, build the trainer's arguments first (`build_sft_config`) and keep them
    alive: their DeepSpeed config makes `from_pretrained` load each rank's partition only
    (`deepspeed.zero.Init`) instead of the whole model on every rank.
    """
    from transformers import AutoModelForCausalLM

    method = cfg.method
    device = cfg.hardware.device
    compute_dtype = training_dtype(cfg)
    kwargs: dict[str, Any] = dict(
        trust_remote_code=cfg.model.trust_remote_code,
        use_safetensors=None if cfg.model.allow_pickle_weights else True,
        attn_implementation=attn_implementation(cfg.train.attention),  # packed rows: train/throughput.py
    )
    if method.name == "full":
        # fp32 master weights; bf16 autocast in the trainer where bf16 is native.
        kwargs["dtype"] = torch.float32
    elif method.name == "lora":
        kwargs["dtype"] = compute_dtype
    else:  # qlora
        quant_dtype = resolve_dtype(method.quant_compute_dtype_on(device), device, key="method.compute_dtype")
        kwargs["dtype"] = quant_dtype
        kwargs["quantization_config"] = quantization_config(method, quant_dtype)
        kwargs["device_map"] = _device_map(cfg)
    source = model_source(cfg.model)
    check_weight_safety(cfg.model, source)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model: cannot load weights from {source} ({first})") from None

    if method.name == "qlora":
        model = prepare_kbit_model(model, quant_dtype)
    if method.uses_adapters:
        from peft import get_peft_model

        with warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` alias.
            warnings.filterwarnings(
                "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            model = get_peft_model(
                model, lora_config(method), autocast_adapter_dtype=method.adapter_dtype == "fp32"
            )
        if method.adapter_dtype == "bf16":
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
    return model, compute_dtype


def prepare_kbit_model(model: Any, compute_dtype: torch.dtype) -> Any:
    """A 4-bit model made ready for adapters: PEFT's `prepare_model_for_kbit_training`, minus its fp32 upcast.

    PEFT upcasts every weight it does not quantize (embeddings, LM head, norms) to fp32: +4 GB on a
    70B, and fp32 hidden states between layers (the checkpointed inputs double). The plan, like the
    QLoRA paper, keeps them in the compute dtype, so they are cast back (scripts/bench_planner.py
    measures this path against the plan). Activation checkpointing is the trainer's to turn on, as for
    every method (SFTConfig's `activation_checkpointing`, which also makes the inputs require grad).
    """
    from peft import prepare_model_for_kbit_training

    disable_cpu_bf16_packing(model)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if compute_dtype != torch.float32:
        for param in model.parameters():
            if param.dtype == torch.float32:
                param.data = param.data.to(compute_dtype)
    return model


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (4-bit weights counted as their unpacked size)."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", None) or param.numel()  # ZeRO-3 partitioned at load: the full count
        quant_state = getattr(param, "quant_state", None)
        if quant_state is not None:  # packed 4-bit storage: count the weight's own shape
            n = quant_state.shape.numel()
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total
