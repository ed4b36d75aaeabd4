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
from finetune.data.prepare import Prepared, PreparedPairs, PreparedPrompts


def save(prepared: Prepared | PreparedPairs | PreparedPrompts, out: Path) -> None:
    """The rows and the histogram into the folder `out` (a cache entry being built)."""
    with _quiet_datasets():
        if isinstance(prepared, PreparedPrompts):
            _save_prompts(prepared, out)
        elif isinstance(prepared, PreparedPairs):
            _save_pairs(prepared, out)
        else:
            _save_rows(prepared, out)


def _save_pairs(prepared: PreparedPairs, out: Path) -> None:
    """Preference pairs, one a row (TRL's prompt_ids, chosen_ids, rejected_ids); eval rows also carry the
    prompt + chosen conversation (`messages`, for generation from the prompt) and prompt + rejected."""
    from datasets import Dataset

    columns = ("prompt_ids", "chosen_ids", "rejected_ids")
    train = {c: [r[c] for r in prepared.train] for c in columns}
    Dataset.from_dict(train).save_to_disk(str(out / rundir.DATA_TRAIN_DIR))
    eval_columns = (*columns, "messages", "rejected")
    evals = {c: [r[c] for r in prepared.evals] for c in eval_columns}
    Dataset.from_dict(evals).save_to_disk(str(out / rundir.DATA_EVAL_DIR), num_shards=1)
    lengths = prepared.stats["splits"]
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {
            "train": [
                len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))
                for r in prepared.train
            ],
            "eval": [
                len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))
                for r in prepared.evals
            ],
        },
        int(prepared.stats["seq_len"]) or max(1, lengths["train"]["max"]),
    )


def _save_prompts(prepared: PreparedPrompts, out: Path) -> None:
    """GRPO's prompts, one a row: `prompt` (messages), `reference`, `prompt_tokens`; eval rows also carry the
    whole conversation (`messages`, JSON) for the held-out generation."""
    from datasets import Dataset

    columns = ("prompt", "reference", "prompt_tokens")
    Dataset.from_dict({c: [r[c] for r in prepared.train] for c in columns}).save_to_disk(
        str(out / rundir.DATA_TRAIN_DIR)
    )
    evals = {c: [r[c] for r in prepared.evals] for c in (*columns, "messages")}
    Dataset.from_dict(evals).save_to_disk(str(out / rundir.DATA_EVAL_DIR), num_shards=1)
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {
            "train": [r["prompt_tokens"] for r in prepared.train],
            "eval": [r["prompt_tokens"] for r in prepared.evals],
        },
        int(prepared.stats["seq_len"]),
    )


def approx_bytes(prepared: Optional[Prepared | PreparedPairs | PreparedPrompts]) -> Optional[int]:
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
    columns = {"input_ids": tokens.ids, "labels": tokens.labels}  # ids uint16/32 and a function: int32 out
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
