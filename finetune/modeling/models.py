"""Loading models and tokenizers: the one place every stage gets them from.

One path for every model: `from_pretrained(source)`, where the source is the hub
id, the folder of a local `config.json`, or the folder the tiny model was built
into (`finetune.modeling.tiny.model_dir`). Every load goes through `load_pretrained`, which
runs the weight-safety check first (`check_weight_safety`): weights load from
safetensors only unless `model.allow_pickle_weights` is set, and every opt-in that
can run code is logged.

- the data stage renders with `load_tokenizer`; training, evaluation and export use
  the same one (the tiny tokenizer, or the model's own);
- training loads with `load_for_training` (full / LoRA / QLoRA, as the method's spec says:
  finetune/core/methods.py);
- evaluation and export load the base, the trained output and the merged model with
  `load_base`, `attach_adapter` and `load_variant` (the base loads as training loaded
  it, so `base` and `trained` differ only by what training changed);
- the pipeline reads a `model.config_path` or `model.gguf_file` once with `resolve_model` (a GGUF file is
  converted once into a cached safetensors folder, finetune/modeling/gguf.py, and loads from there).

Precision: `method.precision` (`auto`: bf16 on GPUs, fp32 on the CPU); bf16 is used
where the device runs it natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX),
elsewhere training falls back to fp32 and says so. Full fine-tuning keeps fp32 master
weights under bf16 autocast; LoRA freezes the base in the compute dtype and keeps the
adapters in `method.adapter_dtype`; QLoRA stores the frozen linear weights in 4 bits (packed in uint8,
or in the training dtype where FSDP2 or ZeRO-3 divide them across ranks).

torch, transformers, PEFT and bitsandbytes are imported inside the functions: the
pipeline imports this module on `mode=plan`'s path, which loads none of them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from finetune import rundir
from finetune.core.architectures import ARCHITECTURES, refusal, unmodelled_option
from finetune.core.config import Config, MethodConfig, ModelConfig
from finetune.core.errors import ConfigError, DataError, LaunchError
from finetune.modeling import gguf, outputs, tiny
from finetune.planner import count_params

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The models a run directory can hold, in the order evaluation compares them.
VARIANTS = ("base", "trained", "merged")

# train.attention -> transformers' `attn_implementation` (finetune/train/throughput.py explains each).
ATTN_IMPLEMENTATIONS = {
    "sdpa": "sdpa",
    "flex": "flex_attention",
    "eager": "eager",
    "flash": "flash_attention_2",
}


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
        return str(tiny.model_dir(model))
    folder = local_folder(model)
    if folder is not None:
        return str(folder)
    if model.hub_id:
        return model.hub_id
    raise ConfigError(f"model.hub_id is not set for model={model.name}: nothing to load the weights from")


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer whose chat template renders the data: the tiny one built locally, else the model's own."""
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


# ---------------------------------------------------------------- a model's config.json


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


# ---------------------------------------------------------------- dtypes


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (elsewhere they are emulated and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_supported(device: str) -> bool:
    import torch

    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def torch_dtype(name: str) -> torch.dtype:
    """`bf16` / `fp32` as the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def resolve_dtype(name: str, device: str, key: str = "method.precision") -> torch.dtype:
    """The torch dtype for `bf16`/`fp32`.

    bf16 on a CPU without AVX512-BF16 or AMX is kept (emulated, slow): tests use it to run the dtypes a
    GPU runs. A GPU without bf16 (before Ampere) falls back to fp32, with a log line.
    """
    import torch

    dtype = torch_dtype(name)
    if dtype == torch.bfloat16 and not bf16_supported(device):
        if device == "cpu":
            log.warning("%s=bf16 is emulated on this CPU (no AVX512-BF16 or AMX): slow", key)
            return dtype
        log.warning("%s=bf16 is not supported by this GPU: training in fp32", key)
        return torch.float32
    return dtype


def training_dtype(cfg: Config) -> torch.dtype:
    """The compute dtype (bf16 or fp32) the run trains in."""
    return resolve_dtype(cfg.method.dtype_on(cfg.hardware.device), cfg.hardware.device)


def eval_dtype(cfg: Config) -> torch.dtype:
    """Evaluation runs in the training compute dtype (bf16 where native, else fp32)."""
    device = cfg.hardware.device
    quantized = cfg.method.spec.quantized_base
    name = cfg.method.quant_compute_dtype_on(device) if quantized else cfg.method.dtype_on(device)
    key = "method.compute_dtype" if quantized else "method.precision"
    return resolve_dtype(name, cfg.hardware.device, key=key)


def attn_implementation(attention: str) -> Optional[str]:
    """`from_pretrained`'s `attn_implementation`; None for sdpa, transformers' own default (SDPA where
    the model supports it, eager where not), so the default path loads exactly as before."""
    return None if attention == "sdpa" else ATTN_IMPLEMENTATIONS[attention]


# ---------------------------------------------------------------- every load goes through here

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


def load_pretrained(model: ModelConfig, source: str, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(source)` after the weight-safety check, safetensors only unless
    `model.allow_pickle_weights`; a folder or hub id that cannot be loaded is one line (ConfigError)."""
    from transformers import AutoModelForCausalLM

    check_weight_safety(model, source)
    try:
        return AutoModelForCausalLM.from_pretrained(
            source,
            trust_remote_code=model.trust_remote_code,
            use_safetensors=None if model.allow_pickle_weights else True,
            **kwargs,
        )
    except OSError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model: cannot load weights from {source} ({first})") from None


# ---------------------------------------------------------------- the pieces each method adds


def quantization_config(
    method: MethodConfig, compute_dtype: torch.dtype, storage_dtype: Optional[torch.dtype] = None
) -> Any:
    """bitsandbytes' 4-bit settings: dequantized to `compute_dtype`, packed into `storage_dtype` (uint8 if None).

    The storage dtype changes no value: the same bytes, read as 2 (uint8) or 4 (bf16) values an element
    (tests/test_qlora_sharded.py), so a base loaded for evaluation or export in uint8 is the trained one.
    """
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=method.quant_type,
        bnb_4bit_use_double_quant=method.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=storage_dtype or torch.uint8,
    )


def disable_cpu_bf16_packing(model: Any) -> int:
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


def lora_config(method: MethodConfig, model: ModelConfig) -> Any:
    """PEFT's LoraConfig of the method on a model of `model`'s architecture (its projections by default)."""
    from peft import LoraConfig

    # the fused 3-D experts are parameters, not linear modules: PEFT reaches them by name
    experts = list(ARCHITECTURES[model.architecture].expert_parameters) if method.lora_experts else None
    return LoraConfig(
        r=method.lora_rank,
        target_parameters=experts,
        lora_alpha=method.lora_alpha,
        lora_dropout=method.lora_dropout,
        target_modules=method.targets(model.architecture),
        bias="none",
        task_type="CAUSAL_LM",
        **dict(method.spec.lora_options),
    )


def prepare_kbit_model(model: Any, compute_dtype: torch.dtype) -> Any:
    """A 4-bit model made ready for adapters: PEFT's `prepare_model_for_kbit_training`, minus its fp32 upcast.

    PEFT upcasts every weight it does not quantize (embeddings, LM head, norms) to fp32: +4 GB on a
    70B, and fp32 hidden states between layers (the checkpointed inputs double). The plan, like the
    QLoRA paper, keeps them in the compute dtype, so they are cast back (scripts/bench_planner.py
    measures this path against the plan). Activation checkpointing is the trainer's to turn on, as for
    every method (SFTConfig's `activation_checkpointing`, which also makes the inputs require grad).
    """
    import torch
    from peft import prepare_model_for_kbit_training

    disable_cpu_bf16_packing(model)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if compute_dtype != torch.float32:
        for param in model.parameters():
            if param.dtype == torch.float32:
                param.data = param.data.to(compute_dtype)
    return model


@contextlib.contextmanager
def _peft_reading_deprecated_alias() -> Iterator[None]:
    """peft (ARCHITECTURE.md, "Checked against") reads transformers' deprecated `is_gradient_checkpointing`
    alias when it wraps a model (get_peft_model, PeftModel.from_pretrained): a FutureWarning a user can do
    nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def add_adapters(model: Any, method: MethodConfig, model_cfg: ModelConfig) -> Any:
    """PEFT's LoRA adapters on a frozen base, kept in `method.adapter_dtype` (PEFT upcasts them to fp32 by
    default; bf16 ones are cast back)."""
    import torch
    from peft import get_peft_model

    with _peft_reading_deprecated_alias():
        model = get_peft_model(
            model, lora_config(method, model_cfg), autocast_adapter_dtype=method.adapter_dtype == "fp32"
        )
    if method.adapter_dtype == "bf16":
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    return model


# ---------------------------------------------------------------- training


def _training_device_map(cfg: Config, sharded: bool) -> Any:
    """Where QLoRA's weights are quantized while they load (bitsandbytes places them at load time).

    ZeRO-3: nowhere given. transformers refuses a device map under ZeRO-3, loads a quantized model without
    zero.Init and quantizes it on this rank's GPU (the CPU without one); DeepSpeed then partitions it, so each
    GPU holds the whole 4-bit base for a moment. FSDP2: the CPU, tensor by tensor as they load; fully_shard
    then moves one decoder layer at a time to this rank's GPU and keeps its shard, so no GPU holds the whole
    4-bit base. One process and DDP: this rank's GPU, or the CPU.
    """
    import torch
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return None
    if cfg.hardware.device == "cuda" and torch.cuda.is_available() and not sharded:
        return {"": int(os.environ.get("LOCAL_RANK", "0"))}
    return {"": "cpu"}


def load_for_training(cfg: Config, sharded: bool = False) -> tuple[Any, torch.dtype]:
    """The model ready to train with `cfg.method`, and the compute dtype (bf16 or fp32) to train it in.

    Under DeepSpeed ZeRO-3, build the trainer's arguments first (`build_sft_config`) and keep them
    alive: their DeepSpeed config makes `from_pretrained` load each rank's partition only
    (`deepspeed.zero.Init`) instead of the whole model on every rank; a quantized model is the
    exception (transformers loads it without zero.Init, see `_training_device_map`).

    `sharded`: the plan's engine divides the weights across ranks (FSDP2, ZeRO-3); QLoRA's 4-bit weights
    are then packed in the training dtype, not uint8.
    """
    import torch

    method, spec = cfg.method, cfg.method.spec
    device = cfg.hardware.device
    compute_dtype = training_dtype(cfg)
    # packed rows: finetune/train/throughput.py
    kwargs: dict[str, Any] = dict(attn_implementation=attn_implementation(cfg.train.attention))
    if spec.trains_base_weights:
        # fp32 master weights; bf16 autocast in the trainer where bf16 is native.
        kwargs["dtype"] = torch.float32
    elif spec.quantized_base:
        quant_dtype = resolve_dtype(method.quant_compute_dtype_on(device), device, key="method.compute_dtype")
        kwargs["dtype"] = quant_dtype
        # FSDP2 and ZeRO-3 divide floating-point parameters only, and cast each to the training dtype (FSDP2's
        # param_dtype, DeepSpeed's bf16): packed in that dtype, the 4-bit weights are divided and never recast.
        storage = compute_dtype if sharded else None
        kwargs["quantization_config"] = quantization_config(method, quant_dtype, storage)
        kwargs["device_map"] = _training_device_map(cfg, sharded)
    else:  # a frozen base in the compute dtype
        kwargs["dtype"] = compute_dtype
    start_adapter, start_weights = initial_output(cfg)
    model = load_pretrained(cfg.model, start_weights or model_source(cfg.model), **kwargs)
    if spec.quantized_base:
        model = prepare_kbit_model(model, quant_dtype)
    if start_adapter is not None:  # init_from's adapter trains on (and is DPO's reference)
        model = _load_adapter(model, start_adapter, is_trainable=True)
    elif spec.adapters:
        model = add_adapters(model, method, cfg.model)
    return model, compute_dtype


def initial_output(cfg: Config) -> tuple[Optional[Path], Optional[str]]:
    """Where training starts under `init_from=RUN_DIR` (SFT, then DPO): (that run's adapter, to train on, when
    this method has adapters and the run saved one; or None) and (the weights to load instead of the base: that
    run's fully trained model or merged export; or None). Without init_from: (None, None)."""
    if not cfg.init_from:
        return None, None
    run = Path(cfg.init_from)
    adapter, model_dir, merged = run / "adapter", run / "model", run / "export" / "merged"
    if cfg.method.spec.adapters and (adapter / "adapter_config.json").is_file():
        return adapter, None
    for folder in (model_dir, merged):
        if (folder / "config.json").is_file():
            return None, str(folder)
    raise ConfigError(
        f"init_from={cfg.init_from}: no adapter/ (for method={cfg.method.name}), model/ or export/merged/ "
        "with a model in it; point it at a finished run directory"
    )


def adapter_on_unchanged_base(cfg: Config) -> bool:
    """The trained adapter sits on the base as it was loaded: with the adapter switched off (or not yet put
    on) the model is the base. Not so under full fine-tuning, nor when the adapter trained is init_from's."""
    return cfg.method.uses_adapters and initial_output(cfg)[0] is None


def trainable_parameters(model: Any) -> tuple[int, int]:
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


# ---------------------------------------------------------------- evaluation and export


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
    if not quantized:
        return load_pretrained(cfg.model, source, dtype=dtype, device_map=devices)
    model = load_pretrained(
        cfg.model,
        source,
        dtype=dtype,
        quantization_config=quantization_config(cfg.method, dtype),
        device_map=devices if devices is not None else {"": "cpu"},
    )
    disable_cpu_bf16_packing(model)
    return model


def attach_adapter(model: Any, adapter: Path) -> Any:
    if not (adapter / "adapter_config.json").is_file():
        raise LaunchError(f"{adapter}: no adapter_config.json; run the training stage (mode=train) first")
    return _load_adapter(model, adapter, is_trainable=False)


def _load_adapter(model: Any, adapter: Path, is_trainable: bool) -> Any:
    """`adapter` put on `model`, after `outputs.check_adapter` (files, identity, base, finite weights); a
    shape PEFT cannot load (another rank, other target modules, another model's width) is one line."""
    from peft import PeftModel

    outputs.check_adapter(adapter, base=getattr(model, "name_or_path", None))
    try:
        with _peft_reading_deprecated_alias():
            peft_model = PeftModel.from_pretrained(model, str(adapter), is_trainable=is_trainable)
    except (RuntimeError, ValueError, KeyError) as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        detail = next((line for line in lines if "size mismatch" in line), lines[0] if lines else "")
        raise LaunchError(
            f"{adapter}: does not fit this model ({type(exc).__name__}: {detail[:240]}); was it trained on "
            "another model, rank or set of target modules?"
        ) from None
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


def load_trained_model(cfg: Config, path: Path, **kwargs: Any) -> Any:
    """The fully fine-tuned model training saved (RUN_DIR/model), through the weight-safety check."""
    if not (path / "config.json").is_file():
        raise LaunchError(f"{path}: no trained model; run the training stage (mode=train) first")
    return load_pretrained(cfg.model, str(path), **kwargs)


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
        return load_pretrained(cfg.model, str(path), dtype=dtype, device_map=devices)
    raise ValueError(f"unknown model variant {variant!r}; one of {', '.join(VARIANTS)}")
