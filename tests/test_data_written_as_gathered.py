"""The packed rows are written as they are gathered: what `Dataset.save_to_disk` writes,
without holding every row.

- `rows._write_dataset` over pieces of any sizes writes the files save_to_disk writes for the whole table:
  the same arrow files (byte for byte but for buffer lengths in later shards; the same record batches), the
  same dataset_info.json, the same state.json but for the fingerprint, which names the rows written.
- `pack.Gathering.list_nbytes` is the table's `nbytes` (save_to_disk's estimate, which sets its shards and
  batch size), known before any piece is made.
- Saving holds about one piece: the peak of Arrow's allocations is a fraction of the table's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset, config, load_from_disk

from finetune.data import pack, rows

NAMES = ("input_ids", "labels", "position_ids", "seq_lengths")
SCHEMA = pa.schema([(name, pa.list_(pa.int32())) for name in NAMES])
_POOLS: list = []


def _samples(n: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids = rng.integers(0, 50_000, size=int(lengths.sum())).astype(np.uint16)
    groups = [list(map(int, g)) for g in np.array_split(rng.permutation(n), max(1, n // 6))] if n else []
    columns = {"input_ids": ids, "labels": lambda index: np.where(index % 3 == 0, -100, ids[index])}
    return columns, starts, lengths, groups


def _pieces(gathering: pack.Gathering, columns: dict):
    return (pa.table({n: arrays[n] for n in NAMES}) for _, arrays in gathering.pieces(columns))


def _nbytes(gathering: pack.Gathering) -> int:
    return 3 * gathering.list_nbytes("token") + gathering.list_nbytes("sample")


def _batches(arrow_file: bytes) -> list[tuple[int, dict]]:
    return [(b.num_rows, b.to_pydict()) for b in pa.ipc.open_stream(arrow_file)]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    "n, num_shards, shard_bytes, batch",
    [(300, None, 25_000, 7), (300, 1, None, 1000), (1, None, None, 1000), (0, 1, None, 1000)],
    ids=["four-shards-batches-of-7", "one-shard", "one-row", "empty"],
)
def test_written_as_gathered_is_what_save_to_disk_writes(
    n, num_shards, shard_bytes, batch, tmp_path, monkeypatch
):
    columns, starts, lengths, groups = _samples(n)
    monkeypatch.setattr(config, "DEFAULT_MAX_BATCH_SIZE", batch)
    if shard_bytes:
        monkeypatch.setattr(config, "MAX_SHARD_SIZE", shard_bytes)
    whole = Dataset(pa.table(pack.gather_rows(columns, starts, lengths, groups), schema=SCHEMA))
    whole.save_to_disk(str(tmp_path / "save_to_disk"), num_shards=num_shards)
    monkeypatch.setattr(pack, "_GATHER_TOKENS", 50)  # pieces of a few rows, cut across shards and batches
    gathering = pack.Gathering(starts, lengths, groups)
    assert _nbytes(gathering) == whole._estimate_nbytes()
    assert n < 2 or len(gathering.spans) > 10
    out = tmp_path / "gathered"
    rows._write_dataset(
        out,
        SCHEMA,
        _pieces(gathering, columns),
        num_rows=gathering.num_rows,
        nbytes=_nbytes(gathering),
        num_shards=num_shards,
    )
    want, got = _files(tmp_path / "save_to_disk"), _files(out)
    assert sorted(got) == sorted(want)
    assert (len([f for f in got if f.endswith(".arrow")]) > 2) == bool(shard_bytes)
    for name in got:
        if name.endswith(".arrow") and not name.startswith("data-00000-"):
            # A later shard: the same record batches, but save_to_disk's are slices of the whole table, whose
            # values buffers Arrow's IPC writer records a few bytes longer (the same values, the same file size).
            assert _batches(got[name]) == _batches(want[name]), name
        elif name != "state.json":
            assert got[name] == want[name], name
    state, want_state = json.loads(got["state.json"]), json.loads(want["state.json"])
    assert {**state, "_fingerprint": None} == {**want_state, "_fingerprint": None}
    loaded = load_from_disk(str(out))
    assert loaded.num_rows == len(groups) and loaded.to_dict() == whole.to_dict()
    if n:
        first = [int(x) for i in groups[0] for x in columns["input_ids"][starts[i] : starts[i] + lengths[i]]]
        assert loaded[0]["input_ids"] == first
        assert loaded[0]["seq_lengths"] == [int(lengths[i]) for i in groups[0]]


def test_the_fingerprint_names_the_rows_not_the_pieces(tmp_path, monkeypatch):
    def fingerprint(seed: int, piece_tokens: int, name: str) -> str:
        columns, starts, lengths, groups = _samples(120, seed)
        monkeypatch.setattr(pack, "_GATHER_TOKENS", piece_tokens)
        g = pack.Gathering(starts, lengths, groups)
        rows._write_dataset(
            tmp_path / name, SCHEMA, _pieces(g, columns), num_rows=g.num_rows, nbytes=_nbytes(g)
        )
        return json.loads((tmp_path / name / "state.json").read_text())["_fingerprint"]

    first = fingerprint(0, 30, "a")
    assert fingerprint(0, 1_000_000, "b") == first
    assert fingerprint(1, 30, "c") != first


def _arrow_peak(n: int, tmp: Path) -> tuple[int, int, int]:
    """(Arrow's peak while writing n samples' rows in pieces of 64k tokens, the table's bytes, what building
    the whole table holds), each counted by a fresh proxy of Arrow's memory pool."""
    columns, starts, lengths, groups = _samples(n)
    g = pack.Gathering(starts, lengths, groups)
    before = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(before)
    # Arrow's buffers point at the pool that made them without owning it: it outlives them all.
    _POOLS.append(pool)
    pa.set_memory_pool(pool)
    try:
        rows._write_dataset(tmp, SCHEMA, _pieces(g, columns), num_rows=g.num_rows, nbytes=_nbytes(g))
        peak = pool.max_memory()
        whole = pa.table(pack.gather_rows(columns, starts, lengths, groups))
        held, whole_bytes = pool.bytes_allocated(), whole.nbytes
        del whole
    finally:
        pa.set_memory_pool(before)
    assert whole_bytes == _nbytes(g) and load_from_disk(str(tmp)).num_rows == len(groups)
    return peak, _nbytes(g), held


def test_saving_holds_about_one_piece(tmp_path, monkeypatch):
    """Rows of 40,000 and of 160,000 samples (8 and 33 MB tables) in pieces of 64k tokens: Arrow's peak while
    writing stays the same (a piece, and a batch of 1,000 rows and its copy: about 5 MB), where building
    the table holds all of it."""
    monkeypatch.setattr(pack, "_GATHER_TOKENS", 1 << 16)
    small_peak, small_bytes, small_held = _arrow_peak(40_000, tmp_path / "small")
    big_peak, big_bytes, big_held = _arrow_peak(160_000, tmp_path / "big")
    assert big_bytes > 3.9 * small_bytes and big_held >= big_bytes > 30e6
    assert big_peak < 1.2 * small_peak and big_peak < 8e6, (small_peak, big_peak)
