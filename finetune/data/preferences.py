"""The `preferences` record kind (DPO): prompt + chosen + rejected, tokenized as TRL's prompt_ids /
chosen_ids / rejected_ids, one pair a row.

Pairs are held in memory as read, one copy at a time (each pair replaced by its cleaned form, then by its
tokens), and the tokens compactly (`PairRows`: 4 bytes a token in flat arrays, not lists of Python ints), so
a pair costs about what its text and tokens take (scripts/measure_data_memory.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from finetune import rundir
from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data import clean, pairs, samples, sources, stats
from finetune.data import rows as saved_rows
from finetune.data.control import ControlTokens
from finetune.data.formats import RecordError
from finetune.data.prepare import TextLimits, progress, records
from finetune.data.render import Renderer

SIDES = ("prompt_ids", "chosen_ids", "rejected_ids")
TEXTS = ("messages", "rejected")


class PairRows:
    """Tokenized pairs, held compactly: each side's token ids of every pair in one flat int32 array with an end
    offset a pair (4 bytes a token), where lists of Python ints held 8 bytes a token plus a 28-byte int object
    for each id past 256. Eval pairs also keep their two conversations' JSON text (`TEXTS`: prompt + chosen,
    for generation; prompt + rejected). `rows[i]` is pair i as TRL's dict of lists."""

    def __init__(self, keep_text: bool = False) -> None:
        self._ids = {side: array("i") for side in SIDES}
        self._ends = {side: array("q") for side in SIDES}
        self.texts: Optional[dict[str, list[str]]] = {t: [] for t in TEXTS} if keep_text else None

    def append(self, ids: tuple[list[int], list[int], list[int]], texts: tuple[str, str] = ("", "")) -> None:
        for side, values in zip(SIDES, ids):
            self._ids[side].extend(values)
            self._ends[side].append(len(self._ids[side]))
        if self.texts is not None:
            for name, text in zip(TEXTS, texts):
                self.texts[name].append(text)

    def __len__(self) -> int:
        return len(self._ends[SIDES[0]])

    def lengths(self, side: str) -> np.ndarray:
        """Each pair's token count on `side` (int64)."""
        return np.diff(np.frombuffer(self._ends[side], dtype=np.int64), prepend=0)

    def pair_tokens(self) -> np.ndarray:
        """Each pair's longer side: prompt plus the longer answer."""
        return self.lengths("prompt_ids") + np.maximum(
            self.lengths("chosen_ids"), self.lengths("rejected_ids")
        )

    def __getitem__(self, i: int) -> dict:
        row: dict = {}
        for side in SIDES:
            ends = self._ends[side]
            row[side] = self._ids[side][ends[i - 1] if i else 0 : ends[i]].tolist()
        if self.texts is not None:
            row.update({name: texts[i] for name, texts in self.texts.items()})
        return row

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    def column(self, name: str) -> Any:
        """One column as Arrow holds it once saved: a side as a list<int64> array (what a list of Python int
        lists was saved as), a text as strings."""
        import pyarrow as pa

        if name in TEXTS:
            return pa.array((self.texts or {})[name], type=pa.string())
        ends = np.frombuffer(self._ends[name], dtype=np.int64)
        offsets = pa.array(np.concatenate([[0], ends]).astype(np.int32))  # a list<> column's offsets
        values = pa.array(np.frombuffer(self._ids[name], dtype=np.int32).astype(np.int64))
        return pa.ListArray.from_arrays(offsets, values)


@dataclass
class PreparedPairs:
    """Preference pairs prepared for DPO, not yet saved: TRL's token ids per pair (`PairRows`), train then eval
    (which also keeps `messages`: prompt + chosen, JSON, and `rejected`: prompt + rejected, JSON)."""

    stats: dict  # data_stats.json's content
    train: PairRows
    evals: PairRows


def prepare(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> PreparedPairs:
    """Preference records prepared for DPO: mapped to pairs (bad ones located), each side cleaned as SFT's
    conversations are, deduplicated, split by prompt (no prompt of an eval pair is trained on), tokenized
    with the chat template, and held to the length limit (the longer side decides: dropped, or both
    answers cut with data.too_long=truncate)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    text = TextLimits.of(cfg, tokenizer, "assistant")
    renderer, char_limit = text.renderer, text.char_limit
    loaded = sources.Loaded()
    del scratch  # preference pairs are held in memory, as read (not streamed to disk)
    with progress(console) as bar:
        found = _read_pairs(records(inp, loaded, bar), loaded, dc)
    samples.check_input(loaded, dc, path, tally)
    if not found:
        raise DataError(f"data.path={path}: no preference pairs ({dict(tally.dropped) or 'no records'})")
    for i, pair in enumerate(found):  # each pair replaced by its cleaned form: one copy held at a time
        found[i] = _clean_pair(pair, dc, text.control, char_limit, tally)
    kept = _dedup_pairs([p for p in found if p is not None], dc, tally)
    del found
    train_pairs, eval_pairs = _split_by_prompt(kept, dc, tally)
    del kept
    seq_len = text.seq_len(cfg)
    truncated = [0]
    had_eval = bool(eval_pairs)
    train = _tokenize_pairs(train_pairs, renderer, seq_len, dc, tally, truncated)
    evals = _tokenize_pairs(eval_pairs, renderer, seq_len, dc, tally, truncated, keep_text=True)
    if not train:
        raise DataError(f"no training pairs left after cleaning and the length limit ({dict(tally.dropped)})")
    if had_eval and not len(evals):
        raise DataError(
            f"no held-out pairs left after the length limit (seq_len {seq_len}): raise train.seq_len, "
            "or set data.eval_fraction=0"
        )
    if cfg.train.seq_len == "auto":
        longest = max(int(rows.pair_tokens().max()) for rows in (train, evals) if len(rows))
        seq_len = min(seq_len, longest)
    result = _pair_stats(cfg, loaded, path, tally, char_limit, train, evals, seq_len, truncated[0])
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return PreparedPairs(result, train, evals)


def _read_pairs(
    records: Iterable[sources.Record], loaded: sources.Loaded, dc: DataConfig
) -> list[pairs.Pair]:
    """The records as they are read, mapped to pairs; one that cannot be is bad input, counted in `loaded`."""
    out = []
    for rec in records:
        try:
            out.append(pairs.to_pair(rec.data, dc))
        except RecordError as exc:
            loaded.add_bad(sources.BadRecord(rec.source, rec.line, exc.reason, str(exc)))
    return out


def _clean_pair(
    pair: pairs.Pair, dc: DataConfig, control: ControlTokens, char_limit: int, tally: samples.Tally
) -> Any:
    """Both sides cleaned as SFT's conversations (empty turns, turn order, characters, control tokens, PII);
    the pair is dropped, counted once under the first side's reason, when either side is."""
    n = len(pair.prompt)
    sides = []
    for whole in pair.sides():
        cleaned = samples.clean_sample(whole, dc, control, char_limit, tally)
        if cleaned is None or len(cleaned) <= n:
            if cleaned is not None:  # truncated into the prompt: no answer left
                tally.dropped["too_long_chars"] += 1
            return None
        sides.append(cleaned)
    chosen, rejected = sides
    if pairs.same_answer(chosen[n:], rejected[n:]):  # scrubbing or escaping made them one
        tally.dropped["identical_pair"] += 1
        return None
    return pairs.Pair(chosen[:n], chosen[n:], rejected[n:])


def _pair_key(pair: pairs.Pair) -> str:
    return clean.conversation_key(pair.prompt + pair.chosen + [{"role": "-", "content": "-"}] + pair.rejected)


def _dedup_pairs(kept: list[pairs.Pair], dc: DataConfig, tally: samples.Tally) -> list[pairs.Pair]:
    """Exact duplicate pairs out (data.dedup); several pairs may share a prompt."""
    if not dc.dedup:
        return kept
    seen: set[bytes] = set()
    out = []
    for p in kept:
        h = clean.exact_digest(_pair_key(p))
        if h in seen:
            tally.dropped["duplicate"] += 1
            continue
        seen.add(h)
        out.append(p)
    return out


def _split_by_prompt(
    kept: list[pairs.Pair], dc: DataConfig, tally: samples.Tally
) -> tuple[list[pairs.Pair], list[pairs.Pair]]:
    """(train, eval) pairs, held out by prompt: the prompts are split (seeded by their keys), every pair
    follows its prompt, and a training pair whose prompt is an exact or near duplicate of an eval prompt is
    dropped (`eval_leak`). A prompt is its user turns (`clean.prompt_key`): the same question under another
    system prompt, or in other spacing or case, is the same prompt."""
    keys = [clean.prompt_key(p.prompt) for p in kept]
    unique = sorted(set(keys))
    n = len(unique)
    n_eval = round(dc.eval_fraction * n)
    if dc.eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    # By the SHA-1 of seed and prompt, as samples.split orders conversations: not by input order.
    order = sorted(range(n), key=lambda i: hashlib.sha1(f"{dc.seed}:{unique[i]}".encode()).digest())
    eval_keys = {unique[i] for i in order[:n_eval]}
    train = [p for p, k in zip(kept, keys) if k not in eval_keys]
    evals = [p for p, k in zip(kept, keys) if k in eval_keys]
    if evals and train:
        train_keys = [k for k in keys if k not in eval_keys]
        del keys
        eval_sorted = sorted(eval_keys)
        sig = _signatures(train_keys + eval_sorted, dc.near_dedup_threshold) if dc.near_dedup else None
        rows = np.arange(len(train_keys) + len(eval_sorted))
        leak = clean.leaks(
            [clean.exact_digest(k) for k in train_keys],
            [clean.exact_digest(k) for k in eval_sorted],
            sig,
            rows[: len(train_keys)],
            rows[len(train_keys) :],
        )
        tally.dropped["eval_leak"] += int(leak.sum())
        train = [p for p, bad in zip(train, leak.tolist()) if not bad]
    return train, evals


def _signatures(keys: list[str], threshold: float) -> clean.Signatures:
    """The MinHash rows of `keys`, computed a block at a time, as the conversations' are: the shingles of one
    block are held, not those of every prompt at once."""
    sig = clean.Signatures(threshold)
    for a in range(0, len(keys), samples._BATCH):
        sig.add(clean.signatures(keys[a : a + samples._BATCH]))
    return sig


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _tokenize_pairs(
    found: list[pairs.Pair],
    renderer: Renderer,
    seq_len: int,
    dc: DataConfig,
    tally: samples.Tally,
    truncated: list[int],
    keep_text: bool = False,
) -> PairRows:
    """Each pair as TRL's token ids: the prompt rendered with the assistant's opening, each answer the
    tokens where prompt + answer departs from it (TRL's own rule, `common_prefix_length`); the length
    limit applied to the prompt plus the longer answer. Each pair of `found` is let go once tokenized."""
    tok = renderer.tokenizer
    out = PairRows(keep_text)
    for i, p in enumerate(found):
        found[i] = None  # type: ignore[call-overload]  # its tokens replace it
        prompt_ids = tok(renderer.text(p.prompt, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        whole = [tok(renderer.text(side), add_special_tokens=False)["input_ids"] for side in p.sides()]
        start = min(_common_prefix_len(prompt_ids, w) for w in whole)
        prompt_ids = prompt_ids[:start]
        chosen_ids, rejected_ids = whole[0][start:], whole[1][start:]
        if not chosen_ids or not rejected_ids:
            tally.dropped["empty_answer_tokens"] += 1
            continue
        longest = start + max(len(chosen_ids), len(rejected_ids))
        if start + min(len(chosen_ids), len(rejected_ids)) < dc.min_tokens:
            tally.dropped["too_short"] += 1
            continue
        if longest > seq_len:
            if dc.too_long == "drop" or start >= seq_len:
                tally.dropped["too_long" if dc.too_long == "drop" else "prompt_too_long"] += 1
                continue
            chosen_ids, rejected_ids = chosen_ids[: seq_len - start], rejected_ids[: seq_len - start]
            truncated[0] += 1
            if chosen_ids == rejected_ids:
                tally.dropped["identical_after_truncation"] += 1
                continue
        texts = (
            (
                json.dumps(p.prompt + p.chosen, ensure_ascii=False),
                json.dumps(p.prompt + p.rejected, ensure_ascii=False),
            )
            if keep_text
            else ("", "")
        )
        out.append((prompt_ids, chosen_ids, rejected_ids), texts)
    return out


def _pair_stats(
    cfg: Config,
    loaded: sources.Loaded,
    path: str,
    tally: samples.Tally,
    char_limit: int,
    train: PairRows,
    evals: PairRows,
    seq_len: int,
    truncated: int,
) -> dict:
    """data_stats.json's content for pairs: the counts, what was dropped and why, and the lengths of the
    prompt, chosen and rejected sides per split."""
    dc = cfg.data

    def lengths(rows: PairRows) -> dict:
        return {
            side: stats.summary(rows.lengths(f"{side}_ids").tolist())
            for side in ("prompt", "chosen", "rejected")
        }

    def pair_tokens(rows: PairRows) -> list[int]:
        return rows.pair_tokens().tolist()

    def total(rows: PairRows) -> int:
        # every token of both sides: the prompt twice
        return int(
            2 * rows.lengths("prompt_ids").sum()
            + rows.lengths("chosen_ids").sum()
            + rows.lengths("rejected_ids").sum()
        )

    return {
        "record_kind": "preferences",
        "num_input": tally.num_input,
        "formats": dict(sorted(loaded.formats.items())),
        "num_train": len(train),
        "num_eval": len(evals),
        "dropped": {k: v for k, v in sorted(tally.dropped.items()) if v},
        "truncated": truncated,
        "max_chars": char_limit,
        "control_tokens": {"mode": dc.control_tokens, "samples": tally.with_control},
        "pii": dict(sorted(tally.pii.items())),
        "skipped_files": loaded.empty_files,
        "bad_input_examples": list(sources.iter_where(loaded)),
        "lengths": {"train": lengths(train), "eval": lengths(evals)},
        # Each pair puts prompt + chosen and prompt + rejected through the model: tokens per pair as the
        # longer side, and every token of both sides.
        "splits": {"train": stats.summary(pair_tokens(train)), "eval": stats.summary(pair_tokens(evals))},
        "tokens": {"train_total": total(train), "eval_total": total(evals)},
        "seq_len": seq_len,
        "seq_len_source": "auto: the longest kept pair" if cfg.train.seq_len == "auto" else "train.seq_len",
        "input": {"path": path, "fingerprint": None},
        "seconds": None,
    }


def save(prepared: PreparedPairs, out: Path) -> None:
    """Preference pairs, one a row (TRL's prompt_ids, chosen_ids, rejected_ids); eval rows also carry the
    prompt + chosen conversation (`messages`, for generation from the prompt) and prompt + rejected."""
    from datasets import Dataset

    with saved_rows.quiet_datasets():
        train = {c: prepared.train.column(c) for c in SIDES}
        Dataset.from_dict(train).save_to_disk(str(out / rundir.DATA_TRAIN_DIR))
        evals = {c: prepared.evals.column(c) for c in (*SIDES, *TEXTS)}
        Dataset.from_dict(evals).save_to_disk(str(out / rundir.DATA_EVAL_DIR), num_shards=1)
        lengths = prepared.stats["splits"]
        stats.histogram(
            out / rundir.DATA_HISTOGRAM_FILE,
            {"train": prepared.train.pair_tokens().tolist(), "eval": prepared.evals.pair_tokens().tolist()},
            int(prepared.stats["seq_len"]) or max(1, lengths["train"]["max"]),
        )
