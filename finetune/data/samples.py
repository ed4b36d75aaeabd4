"""Samples before any token: records mapped to samples (conversations, pairs, labelled examples), cleaned,
deduplicated, split into train and eval.

Records are mapped by their record kind (`conversation` for conversations), cleaned and exactly deduplicated
in one pass as they are read (`collect`), and
only what is kept is held, by a fixed size a sample (`Kept`: three digests, LSH bucket keys and an
offset, about 140 bytes; its JSON text and MinHash row go to a scratch file), so memory follows how
many samples are kept, not the input. Every step keeps input order and counts what
it drops in a `Tally`, under a reason that means one thing (checks run in a fixed order, so a sample
is counted once, by its first problem). The held-out split follows deduplication and is seeded by
the conversations' prompts (conversations asking the same are held out together), so it does not change with
input order; train keeps no exact or near
duplicate of an eval sample, and no sample asking an eval sample's prompt (its user turns, whatever the
system prompt: `clean.prompt_key`). Where several samples share a prompt (preference pairs, labelled
examples), the prompts themselves are split and each sample follows its own (`split_by_prompt`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data import clean, sources
from finetune.data.control import ControlTokens
from finetune.data.formats import Messages, RecordError, to_messages, turn_order_problem


@dataclass
class Tally:
    """What reading and cleaning counted: records read (good or bad), samples dropped by reason (in the
    order first met), personal data scrubbed by kind, and samples with control tokens in their content."""

    num_input: int = 0
    dropped: Counter = field(default_factory=Counter)
    pii: Counter = field(default_factory=Counter)
    with_control: int = 0


class TextStore:
    """The kept samples' JSON texts, appended to a file as they are kept, with an 8-byte end offset each in
    memory: their text is the largest part of a tiny sample, and tokenizing reads it back in batches."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "w+b")  # noqa: SIM115 (closed by `close`)
        self._ends = array("q")

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, text: str) -> None:
        self._file.write(text.encode())
        self._ends.append(self._file.tell())

    def texts(self, rows: Sequence[int] | np.ndarray) -> list[str]:
        """The texts of `rows` (a batch: read with one `pread` over the span they cover when it is short)."""
        self._file.flush()
        ends = np.frombuffer(self._ends, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return []
        starts = np.where(rows > 0, ends[np.maximum(rows - 1, 0)], 0)
        stops = ends[rows]
        lo, hi = int(starts.min()), int(stops.max())
        fd = self._file.fileno()
        if hi - lo <= 4 * int((stops - starts).sum()) + (1 << 16):
            span = os.pread(fd, hi - lo, lo)
            return [span[a - lo : b - lo].decode() for a, b in zip(starts.tolist(), stops.tolist())]
        return [os.pread(fd, b - a, a).decode() for a, b in zip(starts.tolist(), stops.tolist())]

    def close(self) -> None:
        self._file.close()


@dataclass
class Kept:
    """Conversations kept, in input order, each held compactly: its JSON text on disk (`store`: what
    tokenizing reads), the XXH3-128 of its normalized text (`exact`: duplicates and eval leaks, 16 bytes),
    the XXH3-128 of its prompt (`prompts`: `clean.prompt_key`, eval leaks, 16 bytes) and the SHA-1 of the seed
    and that prompt (`order`: the held-out split, 20 bytes), and its MinHash row
    (`signatures`, when deduplication or the split needs one). `rows[i]` is sample i's row in the store and
    the signatures; selections share them, never copy them."""

    store: TextStore
    exact: np.ndarray  # 'S16'
    prompts: np.ndarray  # 'S16'
    order: np.ndarray  # 'S20'
    signatures: Optional[clean.Signatures]
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, picks: Sequence[int] | np.ndarray) -> Kept:
        picks = np.asarray(picks, dtype=np.int64)
        return Kept(
            self.store,
            self.exact[picks],
            self.prompts[picks],
            self.order[picks],
            self.signatures,
            self.rows[picks],
        )

    def close(self) -> None:
        self.store.close()
        if self.signatures is not None:
            self.signatures.close()


@contextmanager
def scratch_folder(where: Optional[Path]) -> Iterator[Path]:
    """A folder for what the streamed pass writes to disk (the kept texts, their MinHash rows), removed when
    done; `where` is the data stage's, inside the cache entry being built, else a temporary one."""
    if where is None:
        with tempfile.TemporaryDirectory(prefix="finetune-data-") as tmp:
            yield Path(tmp)
        return
    where.mkdir(parents=True, exist_ok=True)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


# Samples cleaned before their duplicates are looked up and their MinHash signatures computed together: what
# the pass holds beyond the fixed-size part of each kept sample.
_BATCH = 4096


# A sample as the streamed pass takes it from a record kind: its JSON text (what the kind reads back), the key
# exact duplicates are judged by (normalized text: `clean.conversation_key`) and its prompt (`clean.prompt_key`).
Candidate = tuple[str, str, str]


def conversation(
    data: dict, dc: DataConfig, control: ControlTokens, char_limit: int, tally: Tally, formats: Counter
) -> list[Candidate]:
    """A conversation record as its sample (none where cleaning drops it); `RecordError` where it is bad."""
    sample = clean_sample(to_messages(data, dc, formats), dc, control, char_limit, tally)
    if sample is None:
        return []
    return [
        (json.dumps(sample, ensure_ascii=False), clean.conversation_key(sample), clean.prompt_key(sample))
    ]


def collect(
    records: Iterable[sources.Record],
    loaded: sources.Loaded,
    dc: DataConfig,
    tally: Tally,
    scratch: Path,
    to_samples: Callable[[dict], list[Candidate]],
    by_prompt: bool = False,
) -> Kept:
    """One pass over the records as they are read: each mapped to its samples by `to_samples` (mapped and
    cleaned; one that cannot be mapped raises `RecordError`, bad input counted in `loaded`), exact duplicates
    dropped (data.dedup; the first occurrence wins); what is kept is held compactly (`Kept`: texts and
    signatures written under `scratch`), so memory follows what is kept, by a fixed size a sample.
    MinHash rows are of the whole sample, or with `by_prompt` of its prompt (eval leaks only)."""
    need_signatures = (
        (dc.near_dedup and dc.eval_fraction > 0) if by_prompt else (dc.near_dedup or dc.eval_fraction > 0)
    )
    store = TextStore(scratch / "texts.jsonl")
    signatures = (
        clean.Signatures(dc.near_dedup_threshold, scratch / "signatures.u32") if need_signatures else None
    )
    seen = clean.SeenDigests()
    exact, prompts, order = bytearray(), bytearray(), bytearray()
    # Candidates since the last flush: their JSON text, key, digest and prompt key; `pending` their
    # digests, so a duplicate within the batch is dropped as it is read and costs nothing.
    batch: list[tuple[str, str, bytes, str]] = []
    pending: set[bytes] = set()

    def flush() -> None:
        digests = np.frombuffer(b"".join(d for _, _, d, _ in batch), dtype="S16")
        new = seen.add_new(digests) if dc.dedup else np.ones(len(batch), dtype=bool)
        tally.dropped["duplicate"] += int(len(batch) - new.sum())
        keys = []
        for (text, key, digest, prompt), is_new in zip(batch, new.tolist()):
            if is_new:
                store.add(text)
                exact.extend(digest)
                prompts.extend(clean.exact_digest16(prompt))
                # by prompt: conversations asking the same are held out together
                order.extend(hashlib.sha1(f"{dc.seed}:{prompt}".encode()).digest())
                keys.append(prompt if by_prompt else key)
        if signatures is not None and keys:
            signatures.add(clean.signatures(keys))
        batch.clear()
        pending.clear()

    try:
        for rec in records:
            try:
                found = to_samples(rec.data)
            except RecordError as exc:
                loaded.add_bad(sources.BadRecord(rec.source, rec.line, exc.reason, str(exc)))
                continue
            for text, key, prompt in found:
                digest = clean.exact_digest16(key)
                if dc.dedup:
                    if digest in pending:
                        tally.dropped["duplicate"] += 1
                        continue
                    pending.add(digest)
                batch.append((text, key, digest, prompt))
                if len(batch) >= _BATCH:
                    flush()
        if batch:
            flush()
    except BaseException:  # a read that fails (bad input, a signal): the scratch files closed
        store.close()
        if signatures is not None:
            signatures.close()
        raise
    n = len(store)
    return Kept(
        store,
        np.frombuffer(exact, dtype="S16"),  # views of the bytearrays: no second copy
        np.frombuffer(prompts, dtype="S16"),
        np.frombuffer(order, dtype="S20"),
        signatures,
        np.arange(n),
    )


def check_input(loaded: sources.Loaded, dc: DataConfig, path: str, tally: Tally) -> None:
    """After reading: bad records raise (data.on_error=raise) or are counted as dropped; no record at all raises."""
    tally.num_input = loaded.num_input  # every record read, good or bad
    if (loaded.bad_counts or loaded.empty_files) and dc.on_error == "raise":
        _raise_bad_input(loaded, path, tally.num_input)
    tally.dropped.update(loaded.bad_counts)
    if tally.num_input == 0:
        raise DataError(f"data.path={path}: no records")


def _raise_bad_input(loaded: sources.Loaded, path: str, num_input: int) -> None:
    counts = Counter(loaded.bad_counts)
    if loaded.empty_files:
        counts["empty_file"] += len(loaded.empty_files)
    detail = ", ".join(f"{n} {reason}" for reason, n in counts.most_common())
    if loaded.first_bad:
        first = loaded.first_bad[0]
        head = f"{first.where}: {first.message}"
    else:
        head = f"{loaded.empty_files[0]}: empty file (no records)"
    raise DataError(
        f"{head}; {sum(counts.values())} problems in {num_input} records of data.path={path} ({detail}); "
        "fix the input or set data.on_error=skip to skip and count them"
    )


def clean_sample(
    msgs: Messages, dc: DataConfig, control: ControlTokens, char_limit: int, tally: Tally
) -> Optional[Messages]:
    """One conversation cleaned, or None where dropped; checked in the order that makes each count mean one thing."""
    if any(not m["content"].strip() for m in msgs):
        tally.dropped["empty"] += 1
        return None
    if dc.check_roles and turn_order_problem(msgs):
        tally.dropped["invalid_turn_order"] += 1
        return None
    if sum(len(m["content"]) for m in msgs) > char_limit:  # cannot fit: no rendering, no tokenizing
        if dc.too_long == "drop":
            tally.dropped["too_long_chars"] += 1
            return None
        msgs = _cut(msgs, 2 * char_limit)  # the head, with room: truncation to seq_len follows
    if control.in_messages(msgs):
        tally.with_control += 1
        if dc.control_tokens == "drop":
            tally.dropped["control_tokens"] += 1
            return None
        if dc.control_tokens == "escape":
            msgs = control.escape_messages(msgs)
    if dc.scrub_pii:
        msgs = [{"role": m["role"], "content": clean.scrub_pii(m["content"], tally.pii)} for m in msgs]
    return msgs


def _cut(msgs: Messages, limit: int) -> Messages:
    """The head of a conversation holding `limit` characters of content (data.too_long=truncate)."""
    out: Messages = []
    total = 0
    for m in msgs:
        if total >= limit:
            break
        out.append({**m, "content": m["content"][: limit - total]})
        total += len(out[-1]["content"])
    return out


def near_deduplicate(kept: Kept, dc: DataConfig, tally: Tally, progress) -> Kept:
    """Near duplicates out (data.near_dedup; the first occurrence wins)."""
    if not dc.near_dedup or kept.signatures is None or not len(kept):
        return kept
    task = progress.add_task("near-duplicates", total=1)
    dup = clean.near_duplicates(kept.signatures, kept.rows)
    progress.advance(task)
    tally.dropped["near_duplicate"] += int(dup.sum())
    return kept.select(np.flatnonzero(~dup))


def split(kept: Kept, dc: DataConfig, tally: Tally) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) conversations as rows of `kept.store`, each in input order: held out by seed, after
    deduplication; then no exact or near duplicate of an eval sample stays in train, nor a sample asking an
    eval sample's prompt (`clean.prompt_key`: another system prompt or answer, other spacing or case)."""
    n = len(kept)
    n_eval = round(dc.eval_fraction * n)
    if dc.eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    # By the SHA-1 of seed and prompt, so the split does not change with input order and conversations asking
    # the same are neighbours: held out together, but where the cut falls (a stable sort, as `sorted` is:
    # equal digests keep input order).
    order = np.argsort(kept.order, kind="stable")
    eval_idx, train_idx = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    del order
    if len(eval_idx):
        leak = clean.leaks(
            kept.exact[train_idx],
            kept.exact[eval_idx],
            kept.signatures,
            kept.rows[train_idx],
            kept.rows[eval_idx],
        )
        leak |= np.isin(kept.prompts[train_idx], kept.prompts[eval_idx])
        tally.dropped["eval_leak"] += int(leak.sum())
        train_idx = train_idx[~leak]
    return kept.rows[train_idx], kept.rows[eval_idx]


def split_by_prompt(kept: Kept, dc: DataConfig, tally: Tally) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) samples as rows of `kept.store`, each in input order, held out by prompt where several
    samples share one (preference pairs, labelled examples): the distinct prompts are split (ordered by the
    SHA-1 of seed and prompt, `kept.order`), every sample follows its prompt, and a training sample whose
    prompt is a near duplicate of an eval prompt is dropped (`eval_leak`; its MinHash row is its prompt's)."""
    prompts, group = np.unique(kept.order, return_inverse=True)  # sorted by digest: the seeded order
    n = len(prompts)
    n_eval = round(dc.eval_fraction * n)
    if dc.eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    held_out = group.reshape(-1) < n_eval
    train_idx, eval_idx = np.flatnonzero(~held_out), np.flatnonzero(held_out)
    if len(eval_idx) and len(train_idx):
        leak = clean.leaks(
            kept.prompts[train_idx],
            kept.prompts[eval_idx],
            kept.signatures,
            kept.rows[train_idx],
            kept.rows[eval_idx],
        )
        tally.dropped["eval_leak"] += int(leak.sum())
        train_idx = train_idx[~leak]
    return kept.rows[train_idx], kept.rows[eval_idx]
