"""Samples before any token: records mapped to conversations, cleaned, deduplicated, split into train and eval.

Every step works on conversations (`Messages`) in input order and counts what it
drops in a `Tally`, under a reason that means one thing (checks run in a fixed
order, so a sample is counted once, by its first problem). The held-out split
follows deduplication and is seeded by the conversations' keys, so it does not
change with input order; train keeps no exact or near duplicate of an eval sample.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

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
    """Conversations still kept, with their keys (deduplication, split order) and MinHashes (None: not needed)."""

    messages: list[Messages]
    keys: list[str]
    hashes: Optional[list]

    def select(self, rows: list[int]) -> Kept:
        hashes = [self.hashes[i] for i in rows] if self.hashes is not None else None
        return Kept([self.messages[i] for i in rows], [self.keys[i] for i in rows], hashes)


def read(loaded: sources.Loaded, dc: DataConfig, path: str, tally: Tally, progress) -> list[Messages]:
    """Every record as messages; bad records raise (data.on_error=raise) or are counted as dropped."""
    tally.num_input = loaded.num_input  # every record read, good or bad (before messages add bad ones)
    convs = _to_conversations(loaded, dc, progress)
    if (loaded.bad or loaded.empty_files) and dc.on_error == "raise":
        _raise_bad_input(loaded, path, tally.num_input)
    tally.dropped.update(sources.bad_summary(loaded.bad))
    if tally.num_input == 0:
        raise DataError(f"data.path={path}: no records")
    return convs


def _to_conversations(loaded: sources.Loaded, dc: DataConfig, progress) -> list[Messages]:
    """The records that map to messages; the others join `loaded.bad`, which stays sorted by place."""
    out = []
    task = progress.add_task("messages", total=len(loaded.records))
    for i, rec in enumerate(loaded.records):
        try:
            out.append(to_messages(rec.data, dc))
        except RecordError as exc:
            loaded.bad.append(sources.BadRecord(rec.source, rec.line, exc.reason, str(exc)))
        if i % 1000 == 999:
            progress.update(task, completed=i + 1)
    progress.update(task, completed=len(loaded.records))
    loaded.bad.sort(key=lambda b: (b.source, b.line))
    return out


def _raise_bad_input(loaded: sources.Loaded, path: str, num_input: int) -> None:
    counts = sources.bad_summary(loaded.bad)
    if loaded.empty_files:
        counts["empty_file"] += len(loaded.empty_files)
    detail = ", ".join(f"{n} {reason}" for reason, n in counts.most_common())
    if loaded.bad:
        first = loaded.bad[0]
        head = f"{first.where}: {first.message}"
    else:
        head = f"{loaded.empty_files[0]}: empty file (no records)"
    raise DataError(
        f"{head}; {sum(counts.values())} problems in {num_input} records of data.path={path} ({detail}); "
        "fix the input or set data.on_error=skip to skip and count them"
    )


def cleaned(
    convs: list[Messages], dc: DataConfig, control: ControlTokens, char_limit: int, tally: Tally, progress
) -> list[Messages]:
    """The conversations that pass cleaning (`clean_sample`), in input order."""
    kept: list[Messages] = []
    task = progress.add_task("clean", total=len(convs))
    for msgs in convs:
        progress.advance(task)
        sample = clean_sample(msgs, dc, control, char_limit, tally)
        if sample is not None:
            kept.append(sample)
    return kept


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


def deduplicate(messages: list[Messages], dc: DataConfig, tally: Tally, progress) -> Kept:
    """Exact duplicates out (data.dedup), then near duplicates (data.near_dedup); MinHashes kept for the split."""
    kept = Kept(messages, [clean.conversation_key(m) for m in messages], None)
    if dc.dedup:
        seen: set[str] = set()
        keep = []
        for i, k in enumerate(kept.keys):
            h = clean.exact_hash(k)
            if h in seen:
                tally.dropped["duplicate"] += 1
            else:
                seen.add(h)
                keep.append(i)
        kept = kept.select(keep)
    need_minhash = dc.near_dedup or dc.eval_fraction > 0
    kept.hashes = clean.minhashes(kept.keys) if need_minhash and kept.messages else None
    if dc.near_dedup and kept.hashes is not None:
        task = progress.add_task("near-duplicates", total=1)
        dup = clean.near_duplicates(kept.hashes, dc.near_dedup_threshold)
        progress.advance(task)
        tally.dropped["near_duplicate"] += sum(dup)
        kept = kept.select([i for i, d in enumerate(dup) if not d])
    return kept


def split(kept: Kept, dc: DataConfig, tally: Tally) -> tuple[list[Messages], list[Messages]]:
    """(train, eval) conversations: held out by seed, after deduplication; then no exact or near duplicate
    of an eval sample stays in train."""
    n = len(kept.messages)
    n_eval = round(dc.eval_fraction * n)
    if dc.eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    order = _split_order(kept.keys, dc.seed)
    eval_idx, train_idx = sorted(order[:n_eval]), sorted(order[n_eval:])
    if eval_idx:
        train, evals = kept.select(train_idx), kept.select(eval_idx)
        leak = clean.leaks(train.keys, train.hashes, evals.keys, evals.hashes, dc.near_dedup_threshold)
        tally.dropped["eval_leak"] += sum(leak)
        train_idx = [i for i, bad in zip(train_idx, leak) if not bad]
    return [kept.messages[i] for i in train_idx], [kept.messages[i] for i in eval_idx]


def _split_order(keys: list[str], seed: int) -> list[int]:
    return sorted(range(len(keys)), key=lambda i: hashlib.sha1(f"{seed}:{keys[i]}".encode()).hexdigest())
