"""The tiny vision-language model: an Idefics3 (SmolVLM's architecture) built locally, random init, cached.

`model=tiny model.architecture=idefics3` (recipes/tiny_vlm.yaml) needs no model hub: the tiny tokenizer
(finetune/modeling/tiny.py) plus Idefics3's image tokens, a chat template that renders image parts and
marks the assistant's text with `{% generation %}`, Idefics3's PIL image processor built in code (every
image resized to `model.image_size` square, no tiling), and a SigLIP encoder, pixel-shuffle projector and
Llama decoder initialised at random (seeded) from the model config. Written with `save_pretrained` into
`$FINETUNE_CACHE/tiny/vlm-<fingerprint>/`, so every stage loads it as it would a hub checkpoint
(`AutoModelForImageTextToText`, `AutoProcessor`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config import ModelConfig
from finetune.modeling import cache, tiny

# Idefics3's processor inserts these around and for each image.
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")

# The tiny chat template (tiny.CHAT_TEMPLATE's turns) with a list of text and image parts as content.
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}{% generation %}" + _CONTENT + "{{ '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' }}" + _CONTENT + "{{ '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _processor(model_cfg: ModelConfig) -> Any:
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    # the text tokenizer one size smaller, so its vocabulary plus the image tokens is model.vocab_size
    tok = PreTrainedTokenizerFast.from_pretrained(
        tiny.tokenizer_dir(model_cfg.vocab_size - len(IMAGE_TOKENS))
    )
    tok.add_tokens(list(IMAGE_TOKENS), special_tokens=True)
    side = {"longest_edge": model_cfg.image_size}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    return Idefics3Processor(
        image_processor=images,
        tokenizer=tok,
        image_seq_len=model_cfg.image_tokens,
        chat_template=CHAT_TEMPLATE,
    )


def hf_config(model_cfg: ModelConfig, tok: Any) -> Any:
    """Idefics3's config: the tiny Llama decoder as text_config, a SigLIP encoder as vision_config."""
    from transformers import Idefics3Config

    tower = ARCHITECTURES[model_cfg.architecture].vision
    assert tower is not None
    text = tiny.hf_config(
        replace(model_cfg, architecture=tower.text_architecture),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        hidden_size=model_cfg.vision_hidden_size,
        intermediate_size=model_cfg.vision_intermediate_size,
        num_hidden_layers=model_cfg.vision_layers,
        num_attention_heads=model_cfg.vision_heads,
        image_size=model_cfg.image_size,
        patch_size=model_cfg.patch_size,
    )
    return Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=math.isqrt(model_cfg.vision_token_merge),
        tie_word_embeddings=model_cfg.tie_embeddings,
    )


def model_dir(model_cfg: ModelConfig) -> Path:
    """Build (first call) and return the folder holding the tiny VLM's weights, config and processor."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, GenerationConfig

        processor = _processor(model_cfg)
        tok = processor.tokenizer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tiny.INIT_SEED)
            model = AutoModelForImageTextToText.from_config(hf_config(model_cfg, tok), dtype=torch.float32)
            with torch.no_grad():  # a readable head, as the tiny text model's (tiny._widen_readout)
                model.get_output_embeddings().weight.normal_(0.0, model_cfg.hidden_size**-0.5)
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)

    return cache.build_once(tiny.cache_root() / f"vlm-{tiny.fingerprint(model_cfg)}", build)
