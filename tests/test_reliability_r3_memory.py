"""Preference pairs are held compactly in the data stage: token ids in flat int32 arrays (4 bytes a token), not
lists of Python ints, and saved byte for byte as the lists were. The bytes a pair costs end to end are
measured by scripts/measure_data_memory.py."""

from __future__ import annotations

import numpy as np
import pytest

from finetune.data.preferences import SIDES, PairRows

PAIRS = [
    ([1, 300, 70000], [5, 6], [7, 8, 9]),
    ([2], [40000, 41000, 42000, 43000], [3]),
    ([], [11], [12, 13]),
]
TEXTS = [("[prompt + chosen]", "[prompt + rejected]"), ("a", "b"), ("c", "d")]


def _rows(keep_text: bool) -> PairRows:
    rows = PairRows(keep_text)
    for ids, texts in zip(PAIRS, TEXTS):
        rows.append(ids, texts)
    return rows


def test_token_ids_are_held_in_flat_int32_arrays():
    rows = _rows(keep_text=False)
    for side, i in zip(SIDES, range(3)):
        flat = rows._ids[side]
        assert flat.typecode == "i" and flat.itemsize == 4  # 4 bytes a token
        assert flat.tolist() == [t for ids in PAIRS for t in ids[i]]
        assert rows._ends[side].tolist() == np.cumsum([len(ids[i]) for ids in PAIRS]).tolist()
    assert rows.texts is None and len(rows) == 3
    assert rows[1] == {"prompt_ids": [2], "chosen_ids": [40000, 41000, 42000, 43000], "rejected_ids": [3]}
    assert [r["rejected_ids"] for r in rows] == [[7, 8, 9], [3], [12, 13]]
    assert rows.lengths("chosen_ids").tolist() == [2, 4, 1]
    assert rows.pair_tokens().tolist() == [6, 5, 2]  # prompt + the longer answer
    assert PairRows().pair_tokens().tolist() == []
    with_text = _rows(keep_text=True)
    assert with_text[0]["messages"] == "[prompt + chosen]" and with_text[2]["rejected"] == "d"


@pytest.mark.parametrize("keep_text", [False, True])
def test_saved_pairs_are_the_bytes_the_lists_were_saved_as(tmp_path, keep_text):
    from datasets import Dataset

    rows = _rows(keep_text)
    names = (*SIDES, "messages", "rejected") if keep_text else SIDES
    as_lists = {name: [r[name] for r in rows] for name in names}
    Dataset.from_dict(as_lists).save_to_disk(str(tmp_path / "lists"))
    Dataset.from_dict({name: rows.column(name) for name in names}).save_to_disk(str(tmp_path / "compact"))
    arrow = "data-00000-of-00001.arrow"
    assert (tmp_path / "compact" / arrow).read_bytes() == (tmp_path / "lists" / arrow).read_bytes()
    saved = Dataset.load_from_disk(str(tmp_path / "compact"))
    assert saved.to_dict() == as_lists
    assert str(saved.features["chosen_ids"]) == str(Dataset.from_dict(as_lists).features["chosen_ids"])
