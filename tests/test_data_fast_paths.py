"""The data stage's faster paths give exactly what the libraries' own calls give.

- MinHash rows of a block of keys at once are datasketch's `MinHash.update_batch` values, key for key
  (tiny, long, one- and two-word and empty keys), and another hash function falls back to datasketch.
- Rendering with generation markers matches transformers' `render_jinja_template` (text and spans), and
  the Rust tokenizer read directly matches the transformers tokenizer call (ids and offsets).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from datasketch import MinHash
from transformers.utils.chat_template_utils import render_jinja_template

from finetune.data import clean, synthetic
from finetune.data.render import Renderer

CONVS = synthetic.conversations(40, seed=5, median_words=12)


def _keys() -> list[str]:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    keys = [f"user: count to {i * 7919 % 10_000_000}\nassistant: {i}" for i in range(150)]
    keys += [" ".join(rng.choices(words, k=rng.randint(0, 120))) for _ in range(60)]
    return [*keys, "", "a", "a b", "caf\u00e9 \u00fcber na\u00efve"]


def _datasketch_rows(keys: list[str], **kwargs) -> np.ndarray:
    out = np.empty((len(keys), clean.NUM_PERM), dtype=np.uint32)
    for i, key in enumerate(keys):
        m = MinHash(num_perm=clean.NUM_PERM, **kwargs)
        m.update_batch(clean._shingles(key))
        out[i] = m.hashvalues
    return out


def test_minhash_rows_are_datasketchs():
    keys = _keys()
    assert np.array_equal(clean.signatures(keys), _datasketch_rows(keys))
    assert clean.signatures([]).shape == (0, clean.NUM_PERM)


def test_minhash_falls_back_to_datasketch_for_another_hash(monkeypatch):
    from datasketch import hashfunc

    keys = _keys()[:20]
    monkeypatch.setattr(
        hashfunc, "sha1_hash32", lambda data: 0
    )  # no longer the hash the block path implements
    assert not clean._batchable(MinHash(num_perm=clean.NUM_PERM), clean._shingles(keys[0]))
    assert np.array_equal(clean.signatures(keys), _datasketch_rows(keys))


@pytest.mark.parametrize("template", [synthetic.LLAMA3_MARKERS, synthetic.CHATML_MARKERS])
def test_marker_rendering_and_tokens_are_the_libraries(template):
    tok = synthetic.build_tokenizer(synthetic.corpus_of(CONVS), template, vocab_size=400)
    r = Renderer(tok, "assistant")
    for add in (False, True):
        texts, spans = r._render(CONVS, add_generation_prompt=add, markers=True)
        ref_texts, ref_spans = render_jinja_template(
            conversations=CONVS,
            chat_template=r.template,
            add_generation_prompt=add,
            return_assistant_tokens_mask=True,
            **r.template_kwargs,
        )
        assert texts == ref_texts and spans == ref_spans and any(spans)
    ids, offsets = r._tokenize(texts)
    ref = tok(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    assert ids == list(ref["input_ids"]) and offsets == list(ref["offset_mapping"])
