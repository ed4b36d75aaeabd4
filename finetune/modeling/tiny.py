"""The tiny model of the embedded default: built locally on first use, cached on disk.

`model=tiny` needs no model hub. A byte-level BPE tokenizer is trained on the
bundled chat data (digits split one per token, a chat template with
`{% generation %}` markers so assistant-only labels work), and a
Llama-architecture model is initialised at random (seeded) from the model
config. Both are written with `save_pretrained` (safetensors) into
`$FINETUNE_CACHE/tiny/<fingerprint>/` (default `~/.cache/finetune`), so the
second call, and every later stage, loads them with `from_pretrained(dir)`
exactly as it would a hub model. The fingerprint covers the model config, the
bundled data and `BUILD_VERSION`, so changing any of them builds afresh.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config import ModelConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import RECORD_KINDS, load
from finetune.core.package import PACKAGE_DIR
from finetune.modeling import cache

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

# Bump when the tokenizer or model construction below changes.
BUILD_VERSION = 2
INIT_SEED = 0

BOS, EOS, PAD = "<s>", "<|end|>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 0..5, in this order

# Each turn: role token, newline, content, end token, newline. The assistant's
# content and end token sit inside {% generation %} so TRL/transformers can
# build assistant-only masks; generation stops at <|end|> (the eos token).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def bundled_data_path(record_kind: str = "conversations") -> Path:
    """The bundled data set for `record_kind`: chat conversations (messages JSONL), or the preference pairs
    built from them (scripts/make_bundled_preferences.py): the record kind's `bundled` file."""
    kind = RECORD_KINDS[record_kind]
    if kind.generated:  # made on first use (the bundled images), not shipped
        return Path(load(kind.generated)())
    return PACKAGE_DIR / "data" / "bundled" / kind.bundled


def cache_root() -> Path:
    return cache.root() / "tiny"


def fingerprint(model_cfg: Optional[ModelConfig]) -> str:
    h = hashlib.sha256()
    h.update(f"build={BUILD_VERSION};seed={INIT_SEED}".encode())
    h.update(hashlib.sha256(bundled_data_path().read_bytes()).digest())
    if model_cfg is not None:
        sources = ("name", "hub_id", "config_path", "gguf_file")
        arch = {k: v for k, v in asdict(model_cfg).items() if k not in sources}
        arch = {k: v for k, v in arch.items() if k not in ("allow_pickle_weights", "trust_remote_code")}
        h.update(json.dumps(arch, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _training_texts() -> list[str]:
    texts = []
    with open(bundled_data_path(), encoding="utf-8") as f:
        for line in f:
            for message in json.loads(line)["messages"]:
                texts.append(message["content"])
    return texts


def tokenizer_dir(vocab_size: int) -> Path:
    """Build (first call) and return the folder holding the tiny tokenizer for this vocabulary size."""

    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        # Digits one per token: numbers stay comparable digit by digit (the tasks are arithmetic).
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_training_texts(), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=BOS,
            eos_token=EOS,
            pad_token=PAD,
            additional_special_tokens=list(ROLE_TOKENS),
            model_max_length=1 << 30,
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(out)

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is too small for the tiny byte-level tokenizer (>= 262)"
        )
    return cache.build_once(cache_root() / f"tokenizer-v{vocab_size}-{fingerprint(None)}", build)


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tiny tokenizer (vocabulary `model_cfg.vocab_size`), trained on the bundled data once and cached."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir(model_cfg.vocab_size))
    assert len(tok) <= model_cfg.vocab_size
    return tok


def hf_config(model_cfg: ModelConfig, **extra: Any) -> Any:
    """The transformers config of the architecture in our model config (its model_type's own class, as
    AutoConfig makes it); `extra` adds or replaces keys."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.rms_norm_eps,
        tie_word_embeddings=model_cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": model_cfg.rope_theta},
    )
    arch = ARCHITECTURES[model_cfg.architecture]
    if not arch.fused_projections:  # Phi's head_dim is hidden / heads (ModelConfig checks it)
        common["head_dim"] = model_cfg.head_dim
    if model_cfg.num_experts:
        # Qwen-MoE's keys (every layer sparse unless dense_layers says otherwise); Mixtral's config maps
        # num_experts to num_local_experts and takes its experts' width as intermediate_size
        common.update(num_experts=model_cfg.num_experts, num_experts_per_tok=model_cfg.num_experts_per_token)
        if model_cfg.moe_intermediate_size:
            common.update(
                moe_intermediate_size=model_cfg.moe_intermediate_size,
                mlp_only_layers=list(range(model_cfg.dense_layers)),
                norm_topk_prob=model_cfg.norm_topk_prob,
            )
    if model_cfg.architecture == "llama":
        common.update(attention_bias=model_cfg.attention_bias, mlp_bias=False)
    return AutoConfig.for_model(model_cfg.architecture, **{**common, **extra})


def _widen_readout(model: Any, hidden_size: int) -> None:
    """Initialise the LM head with std 1/sqrt(hidden) instead of 0.02.

    LoRA leaves the head and the final norm frozen, so the logits a tuned model
    can reach are bounded by |head row| x |normed hidden| = std x hidden. At
    std 0.02 and hidden 128 that is about 2.6 nats, too little to ever be
    confident (the loss could not fall below about 3.7); at 1/sqrt(hidden) the
    logits start near unit scale and can grow to about 11, like a pretrained
    model's.
    """
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, hidden_size**-0.5)


def model_dir(model_cfg: ModelConfig) -> Path:
    """Build (first call) and return the folder holding the tiny model's weights and config."""
    tok = load_tokenizer(model_cfg)

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():  # from_config would partition it, and the cache keep empty weights
            raise RuntimeError("the tiny model must be built before a DeepSpeed ZeRO-3 config is live")

        config = hf_config(
            model_cfg,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            _widen_readout(model, model_cfg.hidden_size)
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)  # the model folder is self-contained, like a hub checkpoint

    return cache.build_once(cache_root() / f"model-{fingerprint(model_cfg)}", build)


def load_model(model_cfg: ModelConfig, dtype: Optional[torch.dtype] = None) -> PreTrainedModel:
    """The tiny model (random init, seeded, cached), loaded with `from_pretrained` like a hub model."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir(model_cfg), dtype=dtype or torch.float32, use_safetensors=True
    )
