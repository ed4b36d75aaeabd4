"""The steps every record kind shares: the text limits, the streamed pass over the input, the progress bars.

    read -> samples -> clean -> exact duplicates      (one streamed pass: `samples.collect`)
         -> near duplicates -> split -> tokenize -> length limits -> (pack) -> stats

A record kind (finetune/core/objectives.py's RECORD_KINDS, named by the objective's `record_kind`) is one
module beside this one with `prepare` and `save`: `conversations` (SFT: assistant turns to learn, packed
rows), `preferences` (DPO: prompt + chosen + rejected as TRL's token lists, one pair a row), `labelled` (KTO:
prompt + completion + label), `prompts` (GRPO: prompts with the reference answer the rewards check). Each
streams its records through the same pass (`streamed`: it says how a record becomes its samples, and whether
several samples share a prompt), so the pass holds a fixed size a sample whatever the kind, then reads the
kept samples back a batch at a time (`batches`) for its own tokenizing, into compact rows
(`rows.CompactRows`), and its own statistics; the stage calls the one its objective names.

Pure of the run directory and the cache: a preparation reads only the input, the tokenizer and the config,
and writes nothing but its scratch files (its `save` writes the result), so the stage's fingerprint of those
inputs names the result exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.data import limits, samples, sources
from finetune.data.control import ControlTokens, special_tokens, template_markers
from finetune.data.render import Renderer


@dataclass(frozen=True)
class TextLimits:
    """What every record kind renders and limits text by: the chat template, the control tokens it must not
    meet in user text, the hard token limit and the character limit that stands for it before tokenizing."""

    renderer: Renderer
    control: ControlTokens
    hard: int
    char_limit: int

    @classmethod
    def of(cls, cfg: Config, tokenizer: Any, train_on: str) -> TextLimits:
        renderer = Renderer(tokenizer, train_on)
        control = ControlTokens(special_tokens(tokenizer) | template_markers(renderer.template_texts()))
        hard = limits.hard_limit(cfg)
        return cls(renderer, control, hard, limits.max_chars(tokenizer, hard))

    def seq_len(self, cfg: Config) -> int:
        """train.seq_len, or the hard limit where it is `auto`."""
        return self.hard if cfg.train.seq_len == "auto" else int(cfg.train.seq_len)


@dataclass(frozen=True)
class Streamed:
    """The streamed pass's kept samples split into train and eval rows, with its progress bar and scratch folder."""

    kept: samples.Kept
    train_rows: Any
    eval_rows: Any
    bar: Any
    scratch: Path


@contextmanager
def streamed(
    inp: sources.Input,
    loaded: sources.Loaded,
    dc: DataConfig,
    text: TextLimits,
    path: str,
    tally: samples.Tally,
    scratch: Optional[Path],
    console: Any,
    to_samples: Optional[Callable[[dict], list[samples.Candidate]]] = None,
    by_prompt: bool = False,
) -> Iterator[Streamed]:
    """Every record kind: read, map, clean, deduplicate and split the records, holding a fixed size a sample
    (its JSON text goes to a scratch file); the kept samples' files stay open while the caller reads them.
    `to_samples` maps one record to its cleaned samples (conversations by default); with `by_prompt`, several
    samples may share a prompt (pairs, labelled examples): near duplicates are judged only as eval leaks, by
    prompt, and the split is by prompt (`samples.split_by_prompt`)."""
    if to_samples is None:
        to_samples = partial(
            samples.conversation,
            dc=dc,
            control=text.control,
            char_limit=text.char_limit,
            tally=tally,
            formats=loaded.formats,
        )
    with samples.scratch_folder(scratch) as where, progress(console) as bar:
        kept = samples.collect(records(inp, loaded, bar), loaded, dc, tally, where, to_samples, by_prompt)
        try:
            samples.check_input(loaded, dc, path, tally)
            if by_prompt:
                train_rows, eval_rows = samples.split_by_prompt(kept, dc, tally)
            else:
                kept = samples.near_deduplicate(kept, dc, tally, bar)
                train_rows, eval_rows = samples.split(kept, dc, tally)
            yield Streamed(kept, train_rows, eval_rows, bar, where)
        finally:
            kept.close()


def batches(part: Streamed, rows: Any, what: str) -> Iterator[list[str]]:
    """The JSON texts of `rows` of the kept samples, `samples._BATCH` at a time, with a progress task."""
    task = part.bar.add_task(what, total=len(rows))
    for i in range(0, len(rows), samples._BATCH):
        batch = part.kept.store.texts(rows[i : i + samples._BATCH])
        yield batch
        part.bar.advance(task, len(batch))


def records(inp: sources.Input, loaded: sources.Loaded, bar: Any) -> Iterable[sources.Record]:
    """The input's records as they are read, with a progress task of the bytes (or a data set's rows) read."""
    task = bar.add_task("read" if inp.dataset is None else "read (rows)", total=inp.size)
    return sources.records(inp, loaded, lambda n: bar.advance(task, n))


def progress(console):
    """The data stage's progress bars (rich, on stderr, gone when done): bytes or rows read, then each step."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    class _Amount(MofNCompleteColumn):
        """Bytes for the files being read or hashed, a count for rows and steps."""

        def render(self, task):
            if task.description in ("read", "fingerprint"):
                return DownloadColumn().render(task)
            return super().render(task)

    return Progress(
        TextColumn("data: {task.description:<18}"),
        BarColumn(),
        _Amount(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
