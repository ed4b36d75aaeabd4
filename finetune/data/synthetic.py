"""Synthetic conversations and small local tokenizers, for the tests and `scripts/bench_data.py`.

Nothing here touches the network: tokenizers are trained in memory with the
`tokenizers` library, and the chat templates are copies of the shapes stock
models use (Llama 3 and ChatML), each with and without `{% generation %}`
markers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

# Llama-3 shape. The plain one is how stock templates come (no markers).
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_MARKERS = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_MARKERS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
]


def build_tokenizer(corpus: Iterable[str], template: str = LLAMA3, vocab_size: int = 512) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `corpus`, with `template` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    eos = "<|im_end|>" if "im_start" in template else "<|eot_id|>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token=eos, pad_token="<|pad|>"
    )
    fast.chat_template = template
    return fast


def _words(rng: random.Random, n: int) -> list[str]:
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "an", "el", "or", "us", "ta", "po", "qe"]
    return ["".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def conversations(
    n: int,
    seed: int = 0,
    median_words: int = 60,
    sigma: float = 1.0,
    max_words: int = 1800,
    vocab: int = 2000,
) -> list[list[dict[str, str]]]:
    """`n` multi-turn conversations with long-tailed (log-normal) reply lengths, as real chat data has."""
    rng = random.Random(seed)
    words = _words(random.Random(seed + 1), vocab)
    # Zipf-like word frequencies: the first words are much more frequent.
    weights = [1.0 / (i + 1) for i in range(vocab)]
    cum = []
    total = 0.0
    for w in weights:
        total += w
        cum.append(total)

    def text(k: int) -> str:
        ws = rng.choices(words, cum_weights=cum, k=max(1, k))
        out, line = [], []
        for i, w in enumerate(ws):
            line.append(w)
            if i % 12 == 11:
                out.append(" ".join(line) + ".")
                line = []
        if line:
            out.append(" ".join(line) + ".")
        return " ".join(out).capitalize()

    convs = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": text(rng.randint(5, 30))})
        turns = 1
        while turns < 6 and rng.random() < 0.35:
            turns += 1
        for _ in range(turns):
            q = min(max_words, int(math.exp(rng.gauss(math.log(median_words / 3), sigma))))
            a = min(max_words, int(math.exp(rng.gauss(math.log(median_words), sigma))))
            msgs.append({"role": "user", "content": text(q)})
            msgs.append({"role": "assistant", "content": text(a)})
        convs.append(msgs)
    return convs


def corpus_of(convs: list[list[dict[str, str]]], limit: int = 2000) -> list[str]:
    return [m["content"] for c in convs[:limit] for m in c]
