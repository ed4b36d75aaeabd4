"""Samples before any token: records mapped to conversations, cleaned, deduplicated, split into train and eval.

Records are mapped, cleaned and exactly deduplicated in one pass as they are read (`collect`), and
only what is kept is held, compactly (`Kept`: a JSON text, two digests and a MinHash signature a
sample), so memory follows what is kept, not the input. Every step keeps input order and counts what
it drops in a `Tally`, under a reason that means one thing (checks run in a fixed order, so a sample
is counted once, by its first problem). The held-out split follows deduplication and is seeded by
the conversations' keys, so it does not change with input order; train keeps no exact or near
duplicate of an eval sample.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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


@dataclass
class Kept:
    """Conversations kept, in input order, each held compactly: its JSON text (what tokenizing reads), the
    SHA-1 of its normalized text (`exact`: duplicates and eval leaks) and of the seed and that text
    (`order`: the held-out split), 20 bytes each, and its MinHash signature (row `rows[i]` of
    `signatures`, when deduplication or the split needs one; selections share the matrix, never copy it)."""

    texts: list[str]
    exact: list[bytes]
    order: list[bytes]
    signatures: Optional[np.ndarray]
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)

    def select(self, picks: Sequence[int]) -> Kept:
        picks = list(picks)
        return Kept(
            [self.texts[i] for i in picks],
            [self.exact[i] for i in picks],
            [self.order[i] for i in picks],
            self.signatures,
            self.rows[np.asarray(picks, dtype=np.int64)],
        )


# Keys whose MinHash signatures are computed together (their text is held only this long).
_SIGNATURE_BATCH = 4096


def collect(
    records: Iterable[sources.Record],
    loaded: sources.Loaded,
    dc: DataConfig,
    control: ControlTokens,
    char_limit: int,
    tally: Tally,
) -> Kept:
    """One pass over the records as they are read: each mapped to messages (one that cannot be is bad
    input, counted in `loaded`), cleaned (`clean_sample`), exact duplicates dropped (data.dedup; the
    first occurrence wins); what is kept is held compactly (`Kept`), so memory follows what is kept."""
    need_signatures = dc.near_dedup or dc.eval_fraction > 0
    texts: list[str] = []
    exact: list[bytes] = []
    order: list[bytes] = []
    seen: set[bytes] = set()
    blocks: list[np.ndarray] = []
    pending: list[str] = []
    for rec in records:
        try:
            msgs = to_messages(rec.data, dc)
        except RecordError as exc:
            loaded.add_bad(sources.BadRecord(rec.source, rec.line, exc.reason, str(exc)))
            continue
        sample = clean_sample(msgs, dc, control, char_limit, tally)
        if sample is None:
            continue
        key = clean.conversation_key(sample)
        digest = clean.exact_digest(key)
        if dc.dedup:
            if digest in seen:
                tally.dropped["duplicate"] += 1
                continue
            seen.add(digest)
        texts.append(json.dumps(sample, ensure_ascii=False))
        exact.append(digest)
        order.append(hashlib.sha1(f"{dc.seed}:{key}".encode()).digest())
        if need_signatures:
            pending.append(key)
            if len(pending) == _SIGNATURE_BATCH:
                blocks.append(clean.signatures(pending))
                pending = []
    signatures = None
    if need_signatures:
        blocks.append(clean.signatures(pending))
        signatures = np.empty((len(texts), clean.NUM_PERM), dtype=np.uint32)
        done = 0
        while blocks:  # block by block, each freed once copied: never two copies of them all
            block = blocks.pop(0)
            signatures[done : done + len(block)] = block
            done += len(block)
    return Kept(texts, exact, order, signatures, np.arange(len(texts)))


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
    dup = clean.near_duplicates(kept.signatures, dc.near_dedup_threshold, kept.rows)
    progress.advance(task)
    tally.dropped["near_duplicate"] += int(dup.sum())
    return kept.select(np.flatnonzero(~dup).tolist())


def split(kept: Kept, dc: DataConfig, tally: Tally) -> tuple[list[str], list[str]]:
    """(train, eval) conversations as JSON texts: held out by seed, after deduplication; then no exact or
    near duplicate of an eval sample stays in train."""
    n = len(kept)
    n_eval = round(dc.eval_fraction * n)
    if dc.eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    # By the SHA-1 of seed and text, so the split does not change with input order.
    order = sorted(range(n), key=kept.order.__getitem__)
    eval_idx, train_idx = sorted(order[:n_eval]), sorted(order[n_eval:])
    if eval_idx:
        train, evals = kept.select(train_idx), kept.select(eval_idx)
        leak = clean.leaks(
            train.exact, evals.exact, kept.signatures, train.rows, evals.rows, dc.near_dedup_threshold
        )
        tally.dropped["eval_leak"] += int(leak.sum())
        train_idx = [i for i, bad in zip(train_idx, leak.tolist()) if not bad]
    return [kept.texts[i] for i in train_idx], [kept.texts[i] for i in eval_idx]
