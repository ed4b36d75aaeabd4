"""Prepared conversations saved as rows: what a cache entry holds, and `stage.load_prepared` reads back.

- train/: one packed bin a row: `input_ids`, `labels` (-100 where masked),
  `position_ids` (restarting at every sample) and `seq_lengths`; row 0 holds
  the longest sample;
- eval/: one conversation a row: `input_ids`, `labels` and `messages` (JSON
  text); one shard, even when empty (data.eval_fraction=0);
- the length histogram beside them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from finetune import rundir
from finetune.data import pack, stats
from finetune.data.prepare import Prepared


def save(prepared: Prepared, out: Path) -> None:
    """The rows and the histogram into the folder `out` (a cache entry being built)."""
    with _quiet_datasets():
        _save_rows(prepared, out)


def approx_bytes(prepared: Optional[Prepared]) -> Optional[int]:
    """About what the saved rows take: three 8-byte columns a training token, two an eval token."""
    tokens = (prepared.stats if prepared is not None else {}).get("tokens")
    if not tokens:
        return None
    return 24 * int(tokens["train_total"]) + 16 * int(tokens["eval_total"])


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets' own progress bars off (saving a few files needs none), restored afterwards."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _save_rows(prepared: Prepared, out: Path) -> None:
    import pyarrow as pa
    from datasets import Dataset

    tokens, rows = prepared.tokens, prepared.rows
    columns = {"input_ids": tokens.ids, "labels": tokens.labels}
    groups = [[int(rows.train[i]) for i in b] for b in prepared.bins]
    train = pack.gather_rows(columns, tokens.starts, rows.lengths, groups)
    Dataset(
        pa.table({name: train[name] for name in ("input_ids", "labels", "position_ids", "seq_lengths")})
    ).save_to_disk(str(out / rundir.DATA_TRAIN_DIR))
    del train
    evals = pack.gather_rows(columns, tokens.starts, rows.lengths, [[int(r)] for r in rows.evals])
    messages = pa.array(prepared.eval_messages, pa.string())
    Dataset(
        pa.table({"input_ids": evals["input_ids"], "labels": evals["labels"], "messages": messages})
    ).save_to_disk(str(out / rundir.DATA_EVAL_DIR), num_shards=1)
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {"train": rows.lengths[rows.train].tolist(), "eval": rows.lengths[rows.evals].tolist()},
        rows.seq_len,
    )
