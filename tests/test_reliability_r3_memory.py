"""Every record kind streams through the data stage as SFT's conversations do, and holds its prepared rows
compactly: preference pairs, labelled examples and prompts cost a few hundred bytes each, not the kilobytes
their Python objects took. Rows are held in flat arrays (`rows.CompactRows`: 2 bytes a token where the
vocabulary fits in uint16) and saved as the lists of Python objects were. The end-to-end figure, the data
stage's resident memory, is measured by scripts/measure_data_memory.py."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest
from helpers import tiny_cfg

from finetune.data import labelled, preferences, prompts, rows, samples, sources, stats
from finetune.data.rows import CompactRows

COLUMNS = {
    "prompt_ids": "ids",
    "chosen_ids": "ids",
    "label": "flag",
    "messages": "text",
    "prompt_tokens": "int",
    "prompt": "messages",
}


def _row(rng: random.Random, i: int, vocab: int) -> dict:
    return {
        "prompt_ids": [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))],
        "chosen_ids": [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))],
        "label": rng.random() < 0.5,
        "messages": "héllo ✓ " * rng.randrange(4),
        "prompt_tokens": rng.randrange(10**6),
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"}],
    }


@pytest.mark.parametrize(("vocab", "itemsize"), [(1 << 16, 2), (1 << 16 | 1, 4)])
def test_rows_are_held_in_flat_arrays_two_bytes_a_token_where_the_vocabulary_fits(vocab, itemsize):
    rng = random.Random(0)
    made = [_row(rng, i, vocab) for i in range(50)]
    held = CompactRows(COLUMNS, vocab)
    for row in made:
        held.append(row)
    assert len(held) == 50 and list(held) == made and held[7] == made[7]
    flat = held._values["chosen_ids"]
    assert flat.itemsize == itemsize and flat.tolist() == [t for r in made for t in r["chosen_ids"]]
    assert held.lengths("prompt_ids").tolist() == [len(r["prompt_ids"]) for r in made]
    assert held.values("label").tolist() == [r["label"] for r in made]
    assert held.values("prompt_tokens").tolist() == [r["prompt_tokens"] for r in made]
    # the texts as UTF-8 in one buffer: no Python object a row
    assert bytes(held._values["messages"]) == "".join(r["messages"] for r in made).encode()
    with pytest.raises(IndexError):
        held[50]


@pytest.mark.parametrize("n", [0, 3, 2 * rows.PIECE_ROWS + 5])
def test_saved_rows_are_what_the_lists_were_saved_as(tmp_path, n):
    """Written piece by piece, the rows load back as `Dataset.from_dict(lists).save_to_disk` saved them: the same
    features, values and shards; one piece's token columns byte for byte."""
    from datasets import Dataset

    rng = random.Random(n)
    made = [_row(rng, i, 50_000) for i in range(n)]
    held = CompactRows(COLUMNS, 50_000)
    for row in made:
        held.append(row)
    held.save(tmp_path / "compact")
    saved = Dataset.load_from_disk(str(tmp_path / "compact"))
    assert saved.to_dict() == {c: [r[c] for r in made] for c in COLUMNS}
    if not n:
        assert len(saved) == 0 and list(saved.features) == list(COLUMNS)
        return
    lists = Dataset.from_dict({c: [r[c] for r in made] for c in COLUMNS})
    lists.save_to_disk(str(tmp_path / "lists"))
    assert saved.features == lists.features
    arrow = sorted(p.name for p in (tmp_path / "lists").glob("*.arrow"))
    assert sorted(p.name for p in (tmp_path / "compact").glob("*.arrow")) == arrow
    if n < rows.PIECE_ROWS:
        ids = {"prompt_ids": "ids", "chosen_ids": "ids", "label": "flag", "prompt_tokens": "int"}
        only = CompactRows(ids, 50_000)
        for row in made:
            only.append({c: row[c] for c in ids})
        only.save(tmp_path / "ids")
        Dataset.from_dict({c: [r[c] for r in made] for c in ids}).save_to_disk(str(tmp_path / "ids-lists"))
        assert (tmp_path / "ids" / arrow[0]).read_bytes() == (tmp_path / "ids-lists" / arrow[0]).read_bytes()


# ---------------------------------------------------------------- bytes a record, end to end


def _records(kind: str, n: int) -> list[dict]:
    """`n` distinct records of a dozen words an answer, as scripts/measure_data_memory.py writes them."""
    vocab = [f"word{i}" for i in range(2000)]
    out = []
    for i in range(n):
        rng = random.Random(i)
        question = f"question {i}: " + " ".join(rng.choices(vocab, k=8))
        chosen, rejected = (" ".join(rng.choices(vocab, k=12)) for _ in range(2))
        if kind == "preferences":
            out.append({"prompt": question, "chosen": chosen, "rejected": rejected})
        elif kind == "labelled":
            out.append({"prompt": question, "completion": (chosen, rejected)[i % 2], "label": i % 2 == 0})
        else:
            out.append({"prompt": question, "completion": chosen})
    return out


KINDS = {
    "preferences": (("objective=dpo",), preferences),
    "labelled": (("objective=kto",), labelled),
    "prompts": (("objective=grpo", "objective.num_generations=4"), prompts),
}


def _peak(kind: str, n: int, tokenizer, tmp_path: Path) -> tuple[int, dict]:
    """The peak of Python allocations while `n` records are prepared and saved (the tokenizer's own Rust heap
    is not counted: it does not grow with the records)."""
    objective, module = KINDS[kind]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{kind}-{n}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(kind, n)))
    cfg = tiny_cfg(*objective, "train.seq_len=512")
    inp, _ = sources.open_input(str(path))
    out = tmp_path / f"{kind}-{n}"
    tracemalloc.start()
    try:
        prepared = module.prepare(cfg, tokenizer, inp, str(path), None, scratch=out / ".scratch")
        module.save(prepared, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, prepared.stats


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_record_costs_a_few_hundred_bytes_in_the_data_stage(tmp_path, tiny_tokenizer, monkeypatch, kind):
    """The slope of the peak between 100 and 400 records: what one more record holds through reading,
    cleaning, deduplication, the split, tokenizing and saving. Held as Python objects, a preference pair took
    about 7,500 bytes; streamed and compact, under 1,000 (an SFT conversation: 100 to 300 while read, tests/
    test_reliability_data.py)."""
    # the batches' share of the records held fixed and small, as the SFT test holds it
    monkeypatch.setattr(samples, "_BATCH", 64)
    monkeypatch.setattr(rows, "PIECE_ROWS", 64)
    # the length histogram (matplotlib) holds what its lengths hold, and is slow to trace
    monkeypatch.setattr(stats, "histogram", lambda *args, **kwargs: None)
    samples.clean.signatures(["warm up: datasketch's import is no record's cost"])
    _peak(kind, 20, tiny_tokenizer, tmp_path / "warm")
    (p1, s1), (p2, s2) = (_peak(kind, n, tiny_tokenizer, tmp_path) for n in (100, 400))
    kept = (s2["num_train"] + s2["num_eval"]) - (s1["num_train"] + s1["num_eval"])
    assert kept >= 290, (s1, s2)
    per_record = (p2 - p1) / kept
    assert 0 < per_record < 1000, f"{per_record:.0f} bytes a record ({kind})"
