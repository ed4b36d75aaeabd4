"""Loading a model as a method trains it: every load through `load_pretrained` (the weight-safety check
first), the pieces each method adds (4-bit quantization, LoRA adapters) and `load_for_training`.

Weights load from safetensors only unless `model.allow_pickle_weights` is set, and every opt-in that can
run code is logged. Full fine-tuning keeps fp32 master weights under bf16 autocast; LoRA freezes the base
in the compute dtype and keeps the adapters in `method.adapter_dtype`; QLoRA stores the frozen linear
weights in 4 bits (packed in uint8, or in the training dtype where FSDP2 or ZeRO-3 divide them across
ranks). Which method adds what is its spec's (finetune/core/methods.py); nothing here compares names.

torch, transformers, PEFT and bitsandbytes are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config import Config, MethodConfig, ModelConfig
from finetune.core.errors import ConfigError, LaunchError
from finetune.modeling import outputs
from finetune.modeling.dtypes import resolve_dtype, training_dtype
from finetune.modeling.models import load_tokenizer, model_source

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# train.attention -> transformers' `attn_implementation` (finetune/train/throughput.py explains each).
ATTN_IMPLEMENTATIONS = {
    "sdpa": "sdpa",
    "flex": "flex_attention",
    "eager": "eager",
    "flash": "flash_attention_2",
}


def attn_implementation(attention: Optional[str]) -> Optional[str]:
    """`from_pretrained`'s `attn_implementation`; None for sdpa (and unset, outside training), transformers' own
    default (SDPA where the model supports it, eager where not), so the default path loads exactly as before."""
    return None if attention in (None, "sdpa") else ATTN_IMPLEMENTATIONS[attention]


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


def load_pretrained(model: ModelConfig, source: str, head: str = "lm", seed: int = 0, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(source)` (`AutoModelForImageTextToText` for a model that takes
    images) after the weight-safety check, safetensors only unless `model.allow_pickle_weights`; a folder or
    hub id that cannot be loaded is one line (ConfigError).

    `head="score"` (an objective that trains a score head, finetune/core/objectives.py HEADS): the same weights as
    a sequence classifier with one label; a checkpoint without that head (a base model) gets a new one drawn
    from `seed` (`new_score_head`), so every stage that loads the base sees the head training started from."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    check_weight_safety(model, source)
    auto = AutoModelForImageTextToText if model.takes_images else AutoModelForCausalLM
    try:
        if head == "score":
            return _load_classifier(model, source, seed, **kwargs)
        return auto.from_pretrained(
            source,
            trust_remote_code=model.trust_remote_code,
            use_safetensors=None if model.allow_pickle_weights else True,
            **kwargs,
        )
    except OSError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model: cannot load weights from {source} ({first})") from None


def is_score_checkpoint(config: Any) -> bool:
    """A checkpoint saved with a one-label sequence-classification head (a reward model), by its config."""
    architectures = getattr(config, "architectures", None) or []
    return any(a.endswith("ForSequenceClassification") for a in architectures) and config.num_labels == 1


def _load_classifier(model: ModelConfig, source: str, seed: int, **kwargs: Any) -> Any:
    """`source` as transformers' sequence classifier with one label, its padding id set (the score is read at
    each row's last token before the padding); the LM head of a causal checkpoint is left out, as TRL's
    RewardTrainer loads it."""
    from transformers import AutoModelForSequenceClassification
    from trl.trainer.reward_trainer import suppress_seqcls_warning

    with suppress_seqcls_warning():
        loaded = AutoModelForSequenceClassification.from_pretrained(
            source,
            num_labels=1,
            trust_remote_code=model.trust_remote_code,
            use_safetensors=None if model.allow_pickle_weights else True,
            **kwargs,
        )
    if not is_score_checkpoint(loaded.config):
        new_score_head(loaded, seed)
    text = loaded.config.get_text_config()
    if text.pad_token_id is None:
        text.pad_token_id = load_tokenizer(model).pad_token_id
    return loaded


def new_score_head(model: Any, seed: int) -> None:
    """The new score head drawn as transformers initialises a linear layer (normal, the config's
    initializer_range), from its own generator seeded with `seed`: the same head wherever the base loads."""
    import torch

    weight = model.score.weight
    std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
    gathered: Any = contextlib.nullcontext()
    if hasattr(weight, "ds_id"):  # partitioned by ZeRO-3 while loading: every rank draws the same values
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([weight], modifier_rank=0)
    with gathered, torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        drawn = torch.randn(weight.shape, generator=g, dtype=torch.float32) * std
        weight.copy_(drawn.to(weight.dtype))


# ---------------------------------------------------------------- the pieces each method adds


def quantization_config(
    method: MethodConfig,
    compute_dtype: torch.dtype,
    storage_dtype: Optional[torch.dtype] = None,
    model: Optional[ModelConfig] = None,
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
        # a vision-language model's vision tower and projector stay in 16 bits (the language model is quantized)
        llm_int8_skip_modules=vision_kept_whole(model),
    )


def vision_kept_whole(model: Optional[ModelConfig]) -> Optional[list[str]]:
    """The modules QLoRA leaves unquantized on a vision-language model: its vision encoder, projector and head."""
    tower = ARCHITECTURES[model.architecture].vision if model is not None else None
    if tower is None:
        return None
    return [tower.encoder.rsplit(".", 1)[-1], tower.projector.rsplit(".", 1)[-1], "lm_head"]


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


def lora_config(method: MethodConfig, model: ModelConfig, head: str = "lm") -> Any:
    """PEFT's LoraConfig of the method on a model of `model`'s architecture (its projections by default); with a
    score head (`head="score"`) the head trains in full beside the adapters (PEFT's SEQ_CLS task, which saves it
    with the adapter)."""
    from peft import LoraConfig

    # the fused 3-D experts are parameters, not linear modules: PEFT reaches them by name
    experts = list(ARCHITECTURES[model.architecture].expert_parameters) if method.lora_experts else None
    return LoraConfig(
        r=method.lora_rank,
        target_parameters=experts,
        lora_alpha=method.lora_alpha,
        lora_dropout=method.lora_dropout,
        target_modules=lora_targets(method, model),
        # a score head, or a vision-language model's projector, trains whole beside the adapters
        modules_to_save=["score"] if head == "score" else vision_trained_whole(method, model),
        bias="none",
        task_type="SEQ_CLS" if head == "score" else "CAUSAL_LM",
        **dict(method.spec.lora_options),
    )


def lora_targets(method: MethodConfig, model: ModelConfig) -> Any:
    """PEFT's target_modules: the method's projections; for a vision-language model, as a pattern held to the
    language model (its vision encoder has projections of the same names), and to the vision encoder's linear
    layers too with `method.lora_vision`."""
    targets = method.targets(model.architecture)
    tower = ARCHITECTURES[model.architecture].vision
    if tower is None:
        return targets
    pattern = rf"{re.escape(tower.language_model)}\..*\.({'|'.join(map(re.escape, targets))})"
    if method.lora_vision:
        names = "|".join(map(re.escape, tower.encoder_projections))
        pattern = rf"(?:{pattern}|{re.escape(tower.encoder)}\..*\.({names}))"
    return pattern


def vision_trained_whole(method: MethodConfig, model: ModelConfig) -> Optional[list[str]]:
    """The projector, trained whole (PEFT's modules_to_save) where `method.lora_vision` adapts the image side."""
    tower = ARCHITECTURES[model.architecture].vision
    if tower is None or not method.lora_vision:
        return None
    return [tower.projector.rsplit(".", 1)[-1]]


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
def peft_reading_deprecated_alias() -> Iterator[None]:
    """peft (ARCHITECTURE.md, "Checked against") reads transformers' deprecated `is_gradient_checkpointing`
    alias when it wraps a model (get_peft_model, PeftModel.from_pretrained): a FutureWarning a user can do
    nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def add_adapters(model: Any, method: MethodConfig, model_cfg: ModelConfig, head: str = "lm") -> Any:
    """PEFT's LoRA adapters on a frozen base, kept in `method.adapter_dtype` (PEFT upcasts them to fp32 by
    default; bf16 ones are cast back)."""
    import torch
    from peft import get_peft_model

    with peft_reading_deprecated_alias():
        model = get_peft_model(
            model, lora_config(method, model_cfg, head), autocast_adapter_dtype=method.adapter_dtype == "fp32"
        )
    if method.adapter_dtype == "bf16":
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    return model


# ---------------------------------------------------------------- training


def dequantized_experts(model: ModelConfig, source: str) -> dict[str, Any]:
    """`from_pretrained`'s arguments that load a checkpoint's MXFP4 experts (gpt-oss) dequantized to bf16, as the
    plan's `experts:` line counts them: transformers' MXFP4 quantizer does not train, and keeps the experts
    packed wherever its Triton kernels are installed. Empty for a family or checkpoint without them."""
    if not ARCHITECTURES[model.architecture].expert_storage_bits:
        return {}
    from transformers import AutoConfig
    from transformers.utils.quantization_config import Mxfp4Config

    checkpoint = AutoConfig.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    quant = getattr(checkpoint, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return {"quantization_config": Mxfp4Config(dequantize=True)} if method == "mxfp4" else {}


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
        kwargs["quantization_config"] = quantization_config(method, quant_dtype, storage, cfg.model)
        kwargs["device_map"] = _training_device_map(cfg, sharded)
    else:  # a frozen base in the compute dtype
        kwargs["dtype"] = compute_dtype
    start_adapter, start_weights = initial_output(cfg)
    head = cfg.objective.spec.head
    source = start_weights or model_source(cfg.model)
    if not spec.quantized_base:
        kwargs.update(dequantized_experts(cfg.model, source))
    model = load_pretrained(cfg.model, source, head=head, seed=cfg.train.seed, **kwargs)
    if spec.quantized_base:
        model = prepare_kbit_model(model, quant_dtype)
    if start_adapter is not None:  # init_from's adapter trains on (and is DPO's reference)
        model = _load_adapter(model, start_adapter, is_trainable=True)
    elif spec.adapters:
        model = add_adapters(model, method, cfg.model, head)
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
        with peft_reading_deprecated_alias():
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
