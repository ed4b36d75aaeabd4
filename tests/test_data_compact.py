"""The data stage holds a fixed size a kept sample, and prepares the reference data byte for byte.

- The prepared rows and data_stats.json are the reference ones (the digests below), also with every batch
  cut to a few samples (dedup runs, signature blocks,
  tokenizer calls, row gathering), and with deduplication, near duplicates, eval leaks, truncation and
  packing each on and off.
- The fixed-size parts answer as what they replace: the sorted digest runs as a Python set, the spilled
  MinHash rows as the in-memory matrix, the label bits as the int32 labels.
- The scratch files are gone when the stage is done, and no cache entry lists them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from finetune.core.config import Config, TrainConfig
from finetune.core.config.data import DataConfig
from finetune.data import cache, clean, pack, samples, stage, synthetic, tokens
from finetune.data.render import IGNORE_INDEX, Renderer

# sha256 of every prepared column and the stats (less time, cache and input), prepared from `_inputs()` with
# the tokenizer below: the reference arrow files, byte for byte.
BEFORE = {
    "default": "86ba9c70e6fb96644c2fe403941cf455deeea96fed8b475e442b19ee2d63c71a",
    "truncate": "2f59f765e65b5767167782f816439c46b4cd2563b538c25c560d39548efd4bda",
    "leaks": "860f25090a74e66a0a5051e9ea20a8512f4635e4abf25f2ff6b60dea248144a7",
    "nodedup": "698bc570164938903276d52d3be012039480e8f3706ebea536e4138cf51f7f1e",
}
CONFIGS = {
    "default": ({}, 512),
    "truncate": ({"packing": False, "too_long": "truncate", "train_on": "all"}, 64),
    "leaks": ({"near_dedup": False, "eval_fraction": 0.3}, 512),
    "nodedup": ({"dedup": False, "near_dedup": False, "eval_fraction": 0.0}, 512),
}
DROPPED = {
    "default": {"duplicate": 40, "near_duplicate": 30},
    "truncate": {"duplicate": 40, "near_duplicate": 30},
    # the near duplicates ask what their originals ask: held out with them (by prompt), none leaks
    "leaks": {"duplicate": 40},
    "nodedup": {},
}


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic.build_tokenizer(
        synthetic.corpus_of(synthetic.conversations(60, seed=9, median_words=15)),
        synthetic.LLAMA3,
        vocab_size=400,
    )


def _inputs() -> list[dict]:
    """300 conversations, 40 exact duplicates, 30 near duplicates (a word added), 200 tiny records."""
    convs = synthetic.conversations(300, seed=3, median_words=15, sigma=0.8)
    rows = [{"messages": c} for c in convs]
    rows += [{"messages": c} for c in convs[:40]]
    rows += [
        {"messages": c[:-1] + [{**c[-1], "content": c[-1]["content"] + " indeed"}]} for c in convs[40:70]
    ]
    rows += [{"prompt": f"count to {i}", "completion": f"{i}"} for i in range(200)]
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compact") / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _inputs()))
    return path


def _digest(run: Path) -> str:
    train, evals = stage.load_prepared(run)
    h = hashlib.sha256()
    for ds in (train, evals):
        for c in ds.column_names:
            h.update(c.encode())
            h.update(json.dumps(ds.data.column(c).to_pylist()).encode())
    s = json.loads((run / "data_stats.json").read_text())
    # seconds, cache and input vary by run; formats is counted since these digests were taken
    s = {k: v for k, v in s.items() if k not in ("seconds", "cache", "input", "formats")}
    h.update(json.dumps(s, sort_keys=True).encode())
    return h.hexdigest()


def _prepare(name: str, data: Path, root: Path, tokenizer) -> dict:
    settings, seq_len = CONFIGS[name]
    cfg = Config(
        data=DataConfig(path=str(data), cache_dir=str(root / "cache"), **settings),
        train=TrainConfig(seq_len=seq_len),
    )
    return stage.run(cfg, root / "run", tokenizer=tokenizer)


@pytest.mark.parametrize("name", ["default", "leaks"])
def test_same_rows_as_before_with_batches_of_a_few_samples(name, data, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(samples, "_BATCH", 7)  # dedup runs and signature blocks: many merges
    monkeypatch.setattr(tokens, "BATCH", 5)  # tokenizer calls, mask bits not byte-aligned between them
    monkeypatch.setattr(pack, "_GATHER_TOKENS", 300)
    result = _prepare(name, data, tmp_path, tokenizer)
    assert result["dropped"] == DROPPED[name]
    assert _digest(tmp_path / "run") == BEFORE[name]


@pytest.mark.parametrize("name", ["truncate", "nodedup"])
def test_same_rows_as_before(name, data, tmp_path, tokenizer):
    result = _prepare(name, data, tmp_path, tokenizer)
    assert result["dropped"] == DROPPED[name]
    assert _digest(tmp_path / "run") == BEFORE[name]
    entry = Path(result["cache"]["dir"])
    # The scratch files (texts, MinHash rows, token ids) are gone, and the manifest never listed them.
    assert not any(".scratch" in str(p) for p in (tmp_path / "cache").rglob("*"))
    assert not any(".scratch" in name for name in cache.read_manifest(entry))


def test_seen_digests_answer_as_a_set():
    rng = np.random.default_rng(0)
    pool = np.frombuffer(rng.bytes(16 * 300), dtype="S16")
    seen, reference = clean.SeenDigests(), set()
    for size in (1, 5, 64, 7, 200, 3, 500, 33):
        batch = pool[rng.integers(0, len(pool), size=size)]
        expected = []
        for d in batch.tolist():
            expected.append(d not in reference)
            reference.add(d)
        assert seen.add_new(batch).tolist() == expected
    assert len(seen._runs) < 8 and sum(map(len, seen._runs)) == len(reference)


def test_spilled_signatures_answer_as_in_memory(tmp_path):
    words = [f"w{i}" for i in range(300)]
    rng = np.random.default_rng(1)
    base = [" ".join(rng.choice(words, size=40)) for _ in range(60)]
    keys = base + [b.replace(b.split()[5], "changed", 1) for b in base[:15]]
    sig = clean.signatures(keys)
    spilled = clean.Signatures(0.8, tmp_path / "sig.u32")
    for i in range(0, len(keys), 11):
        spilled.add(sig[i : i + 11])
    memory = clean.Signatures.of(sig, 0.8)
    assert (tmp_path / "sig.u32").stat().st_size == sig.nbytes
    assert all(np.array_equal(spilled.row(i), sig[i]) for i in range(len(keys)))
    dup = clean.near_duplicates(spilled)
    assert dup.tolist() == clean.near_duplicates(memory).tolist()
    assert not dup[:60].any() and dup[60:].sum() >= 8
    rows = np.arange(len(keys))
    exact = [clean.exact_digest16(k) for k in keys]
    leak = clean.leaks(exact[15:60], exact[60:], spilled, rows[15:60], rows[60:])
    assert leak.tolist() == clean.leaks(exact[15:60], exact[60:], memory, rows[15:60], rows[60:]).tolist()
    spilled.close()


def test_label_bits_give_the_labels(tokenizer, tmp_path):
    convs = synthetic.conversations(37, seed=4, median_words=6, sigma=0.5)
    renderer = Renderer(tokenizer, "assistant")
    texts = [json.dumps(c) for c in convs]
    toks = tokens.tokenize([texts[i : i + 6] for i in range(0, 37, 6)], 30, renderer, 1, tmp_path)
    ids, labels = renderer.encode(convs)
    assert toks.ids.dtype == np.uint16 and toks.full_lengths.tolist() == [len(x) for x in ids]
    assert not (tmp_path / "ids.bin").exists()
    for i, (want_ids, want) in enumerate(zip(ids, labels)):
        start, n = int(toks.starts[i]), int(toks.full_lengths[i])
        index = np.arange(start, start + n)
        want = [IGNORE_INDEX] + want[1:]  # the first label is never trained on
        assert toks.ids[index].tolist() == want_ids and toks.labels(index).tolist() == want
        assert toks.trainable_full[i] == sum(x != IGNORE_INDEX for x in want)
    cut = np.maximum(toks.full_lengths - 3, 1)
    expected = [sum(x != IGNORE_INDEX for x in ([IGNORE_INDEX] + lab[1:])[:c]) for lab, c in zip(labels, cut)]
    assert toks.trainable(cut).tolist() == expected
    assert tokens.id_dtype(1 << 16) == np.uint16 and tokens.id_dtype((1 << 16) + 1) == np.uint32
    assert os.listdir(tmp_path) == []
