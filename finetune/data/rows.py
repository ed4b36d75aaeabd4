"""Prepared rows saved in `datasets`' on-disk layout: what a cache entry holds, and `stage.load_prepared` reads
back. The conversations' packed rows are written here piece by piece; each record kind's `save` uses this.

- train/: one packed bin a row: `input_ids`, `labels` (-100 where masked),
  `position_ids` (restarting at every sample) and `seq_lengths`; row 0 holds
  the longest sample;
- eval/: one conversation a row: `input_ids`, `labels` and `messages` (JSON
  text); one shard, even when empty (data.eval_fraction=0);
- the length histogram beside them.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import numpy as np

from finetune import rundir
from finetune.data import pack, stats
from finetune.data.limits import Rows
from finetune.data.tokens import Tokens


def approx_bytes(prepared: Any) -> Optional[int]:
    """About what a preparation's saved rows take (any record kind's, from its stats): three 8-byte columns a
    training token, two an eval token."""
    tokens = (prepared.stats if prepared is not None else {}).get("tokens")
    if not tokens:
        return None
    return 24 * int(tokens["train_total"]) + 16 * int(tokens["eval_total"])


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """datasets' own progress bars off (saving a few files needs none), restored afterwards."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def save_packed(
    tokens: Tokens, rows: Rows, bins: list[list[int]], eval_messages: list[str], out: Path
) -> None:
    """The packed training rows and the eval rows written piece by piece as they are gathered (one piece of
    about a million tokens held, never every row), in save_to_disk's layout (`_write_dataset`), and the
    length histogram."""
    import pyarrow as pa

    columns = {"input_ids": tokens.ids, "labels": tokens.labels}  # ids uint16/32 and a function: int32 out
    packed = pack.Gathering(tokens.starts, rows.lengths, bins, within=rows.train)
    names = ("input_ids", "labels", "position_ids", "seq_lengths")
    _write_dataset(
        out / rundir.DATA_TRAIN_DIR,
        pa.schema([(name, pa.list_(pa.int32())) for name in names]),
        (pa.table({n: arrays[n] for n in names}) for _, arrays in packed.pieces(columns)),
        num_rows=packed.num_rows,
        nbytes=3 * packed.list_nbytes("token") + packed.list_nbytes("sample"),
    )
    del packed
    evals = pack.Gathering(tokens.starts, rows.lengths, None, within=rows.evals)
    messages = eval_messages
    _write_dataset(
        out / rundir.DATA_EVAL_DIR,
        pa.schema(
            [("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())), ("messages", pa.string())]
        ),
        (
            pa.table({**{n: arrays[n] for n in columns}, "messages": pa.array(messages[r0:r1], pa.string())})
            for (r0, r1), arrays in evals.pieces(columns)
        ),
        num_rows=evals.num_rows,
        # the messages as a string array: four bytes a row (pyarrow counts an offset a string) and their UTF-8
        nbytes=2 * evals.list_nbytes("token") + 4 * len(messages) + sum(len(m.encode()) for m in messages),
        num_shards=1,
    )
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {"train": rows.lengths[rows.train], "eval": rows.lengths[rows.evals]},
        rows.seq_len,
    )


# What a `CompactRows` column holds, and how it is saved: token ids (list<int64>, as lists of Python ints were
# saved), text (string), an int (int64), a flag (bool), or a conversation's messages (JSON text held, saved as a
# list of {role, content} structs, as lists of those dicts were).
COLUMN_KINDS = ("ids", "text", "int", "flag", "messages")

# Rows in one saved piece: what the save holds beyond the compact rows themselves.
PIECE_ROWS = 4096


class CompactRows:
    """Rows of a record kind held compactly until saved, without a Python object a row: token ids in one flat
    array a column (2 bytes a token where the vocabulary fits in uint16, else 4) with an end offset a row,
    texts as UTF-8 in one buffer a column with an end offset a row, ints and flags in one array a column.
    `rows[i]` is row i as the dict TRL reads; `save` writes them piece by piece as
    `Dataset.from_dict(...).save_to_disk` writes the same rows as lists."""

    def __init__(self, columns: dict[str, str], vocab_size: int = 1 << 31) -> None:
        unknown = set(columns.values()) - set(COLUMN_KINDS)
        assert not unknown, unknown
        self.kinds = dict(columns)
        code = "H" if vocab_size <= 1 << 16 else "I"
        self._values: dict[str, Any] = {}
        self._ends: dict[str, array] = {}
        for name, kind in columns.items():
            if kind == "ids":
                self._values[name], self._ends[name] = array(code), array("q")
            elif kind in ("text", "messages"):
                self._values[name], self._ends[name] = bytearray(), array("q")
            else:
                self._values[name] = array("q") if kind == "int" else bytearray()
        self._count = 0

    def append(self, row: dict) -> None:
        """One row: a value for every column (token ids as a list of ints, messages as a list of dicts)."""
        for name, kind in self.kinds.items():
            value, store = row[name], self._values[name]
            if kind == "ids":
                store.extend(value)
            elif kind == "text":
                store.extend(value.encode())
            elif kind == "messages":
                store.extend(json.dumps(value, ensure_ascii=False).encode())
            elif kind == "int":
                store.append(int(value))
            else:
                store.append(1 if value else 0)
            if name in self._ends:
                self._ends[name].append(len(store))
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def _span(self, name: str, i: int) -> tuple[int, int]:
        ends = self._ends[name]
        return (ends[i - 1] if i else 0), ends[i]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self._count:
            raise IndexError(i)
        row: dict = {}
        for name, kind in self.kinds.items():
            store = self._values[name]
            if kind in ("ids", "text", "messages"):
                a, b = self._span(name, i)
                if kind == "ids":
                    row[name] = store[a:b].tolist()
                else:
                    text = bytes(store[a:b]).decode()
                    row[name] = text if kind == "text" else json.loads(text)
            else:
                row[name] = int(store[i]) if kind == "int" else bool(store[i])
        return row

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(self._count))

    def lengths(self, name: str) -> np.ndarray:
        """Each row's token count in the ids column `name` (int64)."""
        return np.diff(np.frombuffer(self._ends[name], dtype=np.int64), prepend=0)

    def values(self, name: str) -> np.ndarray:
        """An int (int64) or flag (bool) column as an array."""
        store = self._values[name]
        if self.kinds[name] == "int":
            return np.frombuffer(store, dtype=np.int64)
        return np.frombuffer(store, dtype=np.uint8).astype(bool)

    def column(self, name: str, start: int = 0, stop: Optional[int] = None) -> Any:
        """Rows [start, stop) of one column as Arrow holds it once saved (the types `COLUMN_KINDS` names)."""
        import pyarrow as pa

        stop = self._count if stop is None else stop
        kind, store = self.kinds[name], self._values[name]
        if kind in ("int", "flag"):
            values = self.values(name)[start:stop]
            return pa.array(values, pa.int64() if kind == "int" else pa.bool_())
        ends = np.frombuffer(self._ends[name], dtype=np.int64)
        first = int(ends[start - 1]) if start else 0
        offsets = np.concatenate([[first], ends[start:stop]]) - first
        last = int(offsets[-1]) + first
        if kind == "ids":
            flat = np.frombuffer(store, dtype=np.dtype(store.typecode))[first:last].astype(np.int64)
            return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
        data = pa.py_buffer(bytes(store[first:last]))
        texts = pa.StringArray.from_buffers(
            stop - start, pa.py_buffer(offsets.astype(np.int32).tobytes()), data
        )
        if kind == "text":
            return texts
        messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
        return pa.array([json.loads(t) for t in texts.to_pylist()], messages)

    def _table(self, start: int, stop: int) -> Any:
        import pyarrow as pa

        return pa.table({name: self.column(name, start, stop) for name in self.kinds})

    def save(self, folder: Path, num_shards: Optional[int] = None) -> None:
        """The rows in save_to_disk's layout under `folder`, written piece by piece (`_write_dataset`)."""
        pieces = range(0, self._count, PIECE_ROWS)
        # pyarrow's nbytes of the whole table, as save_to_disk sizes its shards and batches by it: the pieces'
        # nbytes add up to it but for the flags' bitmaps (a byte for eight rows of the whole)
        nbytes = 0
        for start in pieces:
            table = self._table(start, min(start + PIECE_ROWS, self._count))
            nbytes += sum(table[n].nbytes for n, k in self.kinds.items() if k != "flag")
        nbytes += sum((self._count + 7) // 8 for k in self.kinds.values() if k == "flag")
        _write_dataset(
            folder,
            self._table(0, 0).schema,
            (self._table(a, min(a + PIECE_ROWS, self._count)) for a in pieces),
            num_rows=self._count,
            nbytes=nbytes,
            # no rows: one empty shard, which loads back (none would not)
            num_shards=num_shards if num_shards is not None or self._count else 1,
        )


def _write_dataset(
    folder: Path,
    schema: Any,
    pieces: Iterable[Any],
    *,
    num_rows: int,
    nbytes: int,
    num_shards: Optional[int] = None,
) -> None:
    """What `Dataset.save_to_disk(folder, num_shards=num_shards)` writes for a table of `num_rows` rows taking
    `nbytes` (its `_estimate_nbytes`), from that table's `pieces` (`pyarrow.Table`s in row order) as they come:
    the same contiguous shards, record batches of its writer batch size, state.json and dataset_info.json,
    through datasets' own `ArrowWriter`; one piece and one batch held, never the table.

    One difference: state.json's `_fingerprint` is an XXH3 of the rows written (save_to_disk's is datasets'
    hash of the whole in-memory table, which pickles it); it names the content all the same.
    """
    import xxhash
    from datasets import config
    from datasets.arrow_writer import ArrowWriter, get_writer_batch_size_from_data_size
    from datasets.features import Features
    from datasets.info import DatasetInfo
    from datasets.utils.py_utils import asdict, convert_file_size_to_int

    if num_shards is None:
        num_shards = min(num_rows, int(nbytes / convert_file_size_to_int(config.MAX_SHARD_SIZE)) + 1)
    batch = config.DEFAULT_MAX_BATCH_SIZE
    if nbytes > 0:
        batch = min(batch, get_writer_batch_size_from_data_size(num_rows, nbytes))
    div, mod = divmod(num_rows, num_shards) if num_shards else (0, 0)
    ends = [div * (k + 1) + min(k + 1, mod) for k in range(num_shards)]  # Dataset.shard(contiguous=True)'s
    files = [f"data-{k:05d}-of-{num_shards:05d}.arrow" for k in range(num_shards)]
    features = Features.from_arrow_schema(schema)
    taken = _Taken(iter(pieces), schema)
    digest = xxhash.xxh3_64()
    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(files):
        writer = ArrowWriter(features=features, path=str(folder / name), embed_local_files=True)
        try:
            for start in range(ends[k - 1] if k else 0, ends[k], batch):
                table = taken.rows(min(batch, ends[k] - start))
                for record_batch in table.combine_chunks().to_batches():
                    digest.update(record_batch.serialize())
                writer.write_table(table)
            writer.finalize()
        finally:
            writer.close()
    state: dict[str, Any] = {
        "_data_files": [{"filename": name} for name in files],
        "_fingerprint": digest.hexdigest(),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    with (folder / config.DATASET_STATE_JSON_FILENAME).open("w", encoding="utf-8") as f:
        json.dump(state, f, indent=2, sort_keys=True)
    info = asdict(DatasetInfo(features=features))
    with (folder / config.DATASET_INFO_FILENAME).open("w", encoding="utf-8") as f:
        # save_to_disk sorts only the first level of keys (nested features keep their order)
        json.dump({key: info[key] for key in sorted(info)}, f, indent=2)


class _Taken:
    """Rows taken in order from a stream of tables of any sizes: `rows(n)` gives the next n as one table."""

    def __init__(self, pieces: Iterator[Any], schema: Any) -> None:
        self._pieces, self._schema, self._left = pieces, schema, schema.empty_table()

    def rows(self, n: int) -> Any:
        import pyarrow as pa

        parts = []
        while n > 0:
            if not self._left.num_rows:
                self._left = next(self._pieces)
            part = self._left.slice(0, n)
            self._left = self._left.slice(part.num_rows)
            parts.append(part)
            n -= part.num_rows
        return pa.concat_tables(parts) if parts else self._schema.empty_table()
