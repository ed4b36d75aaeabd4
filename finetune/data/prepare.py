"""What a cache miss runs: the input's records in, kept samples, packed bins and data_stats.json's content out.

    read -> messages -> clean -> exact duplicates     (one streamed pass: `samples.collect`)
         -> near duplicates -> split -> tokenize -> length limits -> pack -> stats

Pure of the run directory and the cache: it reads only the input, the
tokenizer and the config, and writes nothing (`rows.save` writes the result),
so the stage's fingerprint of those inputs names the result exactly.

One function per record kind (`RECORD_KINDS`, named by the objective's
`ObjectiveSpec.record_kind`): `conversations` (SFT: assistant turns to learn,
packed rows) and `preferences` (DPO: prompt + chosen + rejected, tokenized as
TRL's prompt_ids / chosen_ids / rejected_ids, one pair a row). Each reuses the
sample steps (`samples`) and the limits, and brings its own tokenizing; the
stage calls the one its objective names.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data import clean, limits, pack, pairs, samples, sources, stats
from finetune.data.control import ControlTokens, special_tokens, template_markers
from finetune.data.formats import Messages, RecordError
from finetune.data.limits import Rows
from finetune.data.render import Renderer
from finetune.data.tokens import BATCH, Tokens, check_labels, tokenize


@dataclass
class Prepared:
    """Conversations prepared for SFT, not yet saved: the rows kept and how the training rows pack."""

    stats: dict  # data_stats.json's content
    tokens: Tokens
    rows: Rows
    bins: list[list[int]]  # training rows packed: each bin lists positions in `rows.train`, longest bin first
    eval_messages: list[str]  # the conversation of each eval row (JSON text), for generation from its prompt


def conversations(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> Prepared:
    """Conversation records prepared for SFT: cleaned, split, tokenized with masked labels, limited, packed;
    what the pass holds per sample beyond a fixed size goes to files under `scratch` (removed when done)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    loaded = sources.Loaded()
    text = _TextLimits.of(cfg, tokenizer, dc.train_on)
    with _streamed(inp, loaded, dc, text, path, tally, scratch, console) as part:
        tokens = tokenize(
            _batches(part.kept.store, part.train_rows, part.eval_rows, part.bar),
            len(part.train_rows),
            text.renderer,
            dc.num_proc,
            part.scratch,
        )
        check_labels(tokens, dc.train_on)
        rows = limits.apply(tokens, cfg, text.hard, tally.dropped)
        eval_messages = part.kept.store.texts(part.eval_rows[rows.evals - tokens.num_train])
    bins = _bins(rows, dc)
    result = _stats(cfg, loaded, path, tally, text.char_limit, text.renderer, tokens, rows, bins)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return Prepared(result, tokens, rows, bins, eval_messages)


@dataclass(frozen=True)
class _TextLimits:
    """What every record kind renders and limits text by: the chat template, the control tokens it must not
    meet in user text, the hard token limit and the character limit that stands for it before tokenizing."""

    renderer: Renderer
    control: ControlTokens
    hard: int
    char_limit: int

    @classmethod
    def of(cls, cfg: Config, tokenizer: Any, train_on: str) -> _TextLimits:
        renderer = Renderer(tokenizer, train_on)
        control = ControlTokens(special_tokens(tokenizer) | template_markers(renderer.template_texts()))
        hard = limits.hard_limit(cfg)
        return cls(renderer, control, hard, limits.max_chars(tokenizer, hard))

    def seq_len(self, cfg: Config) -> int:
        """train.seq_len, or the hard limit where it is `auto`."""
        return self.hard if cfg.train.seq_len == "auto" else int(cfg.train.seq_len)


@dataclass(frozen=True)
class _Streamed:
    """The streamed pass's kept samples split into train and eval rows, with its progress bar and scratch folder."""

    kept: samples.Kept
    train_rows: Any
    eval_rows: Any
    bar: Any
    scratch: Path


@contextmanager
def _streamed(
    inp: sources.Input,
    loaded: sources.Loaded,
    dc: DataConfig,
    text: _TextLimits,
    path: str,
    tally: samples.Tally,
    scratch: Optional[Path],
    console: Any,
) -> Iterator[_Streamed]:
    """Conversations and prompts alike: read, clean, deduplicate (exact, then near) and split the records,
    holding a fixed size a sample; the kept samples' files stay open while the caller reads them."""
    with samples.scratch_folder(scratch) as where, progress(console) as bar:
        kept = samples.collect(
            _records(inp, loaded, bar), loaded, dc, text.control, text.char_limit, tally, where
        )
        try:
            samples.check_input(loaded, dc, path, tally)
            kept = samples.near_deduplicate(kept, dc, tally, bar)
            train_rows, eval_rows = samples.split(kept, dc, tally)
            yield _Streamed(kept, train_rows, eval_rows, bar, where)
        finally:
            kept.close()


def _batches(store: samples.TextStore, train_rows: Any, eval_rows: Any, bar: Any) -> Iterator[list[str]]:
    """The texts of the training rows, then the eval rows, `tokens.BATCH` at a time, with a progress task."""
    task = bar.add_task("render+tokenize", total=len(train_rows) + len(eval_rows))
    for rows in (train_rows, eval_rows):
        for i in range(0, len(rows), BATCH):
            batch = store.texts(rows[i : i + BATCH])
            yield batch
            bar.advance(task, len(batch))


def _records(inp: sources.Input, loaded: sources.Loaded, bar: Any) -> Iterable[sources.Record]:
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


def _bins(rows: Rows, dc: DataConfig) -> list[list[int]]:
    """Training rows packed into bins (best fit decreasing, longest first; data.packing=false: one a bin)."""
    train_lengths = rows.lengths[rows.train].tolist()
    if dc.packing:
        bins = pack.best_fit_decreasing(train_lengths, rows.seq_len)
    else:
        bins = [[i] for i in range(len(rows.train))]
    return pack.order_bins(bins, train_lengths, dc.seed)


def _stats(
    cfg: Config,
    loaded: sources.Loaded,
    path: str,
    tally: samples.Tally,
    char_limit: int,
    renderer: Renderer,
    tokens: Tokens,
    rows: Rows,
    bins: list[list[int]],
) -> dict:
    """data_stats.json's content (less the cache, the input fingerprint and the seconds, filled in later)."""
    dc, seq_len = cfg.data, rows.seq_len
    train_lengths = rows.lengths[rows.train].tolist()
    return {
        "num_input": tally.num_input,
        "num_train": len(rows.train),
        "num_eval": len(rows.evals),
        "dropped": {k: v for k, v in sorted(tally.dropped.items()) if v},
        "truncated": rows.truncated,
        "max_chars": char_limit,
        "control_tokens": {"mode": dc.control_tokens, "samples": tally.with_control},
        "pii": dict(sorted(tally.pii.items())),
        "skipped_files": loaded.empty_files,
        "bad_input_examples": list(sources.iter_where(loaded)),
        **_token_stats(tokens, rows),
        "empty_masks": rows.empty_masks,
        "masks": {
            "train_on": dc.train_on,
            "method": "generation_markers"
            if renderer.markers or dc.train_on == "all"
            else "prefix_rendering",
            "search_fallbacks": renderer.prefix_fallbacks,
        },
        "packing": {
            "enabled": dc.packing,
            "bins": len(bins),
            "efficiency": round(pack.efficiency(train_lengths, bins, seq_len), 6),
            "seq_len": seq_len,
            "longest_first": True,
        },
        "seq_len": seq_len,
        "seq_len_source": (
            f"auto: p{dc.seq_len_percentile:g} of kept lengths"
            if cfg.train.seq_len == "auto"
            else "train.seq_len"
        ),
        "input": {"path": path, "fingerprint": None},
        "seconds": None,
    }


def _token_stats(tokens: Tokens, rows: Rows) -> dict:
    """data_stats.json's `tokens`, `splits` and `trainable_tokens`: lengths after the limits, by split."""
    train_lengths = rows.lengths[rows.train].tolist()
    eval_lengths = rows.lengths[rows.evals].tolist()
    overall = stats.summary(train_lengths + eval_lengths)
    trainable = tokens.trainable(rows.lengths)
    return {
        "tokens": {
            "train_total": sum(train_lengths),
            "eval_total": sum(eval_lengths),
            **{k: overall[k] for k in ("min", "p50", "p95", "p99", "max")},
        },
        "splits": {"train": stats.summary(train_lengths), "eval": stats.summary(eval_lengths)},
        "trainable_tokens": {
            "train": int(trainable[rows.train].sum()),
            "eval": int(trainable[rows.evals].sum()),
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# Preference pairs (DPO)


@dataclass
class PreparedPairs:
    """Preference pairs prepared for DPO, not yet saved: TRL's token lists per pair, train then eval."""

    stats: dict  # data_stats.json's content
    train: list[dict]  # {prompt_ids, chosen_ids, rejected_ids}
    evals: list[dict]  # the same, plus `messages` (prompt + chosen, JSON) and `rejected` (JSON)


def preferences(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> PreparedPairs:
    """Preference records prepared for DPO: mapped to pairs (bad ones located), each side cleaned as SFT's
    conversations are, deduplicated, split by prompt (no prompt of an eval pair is trained on), tokenized
    with the chat template, and held to the length limit (the longer side decides: dropped, or both
    answers cut with data.too_long=truncate)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    text = _TextLimits.of(cfg, tokenizer, "assistant")
    renderer, char_limit = text.renderer, text.char_limit
    loaded = sources.Loaded()
    del scratch  # preference pairs are held in memory, as read (not streamed to disk)
    with progress(console) as bar:
        found = _read_pairs(_records(inp, loaded, bar), loaded, dc)
    samples.check_input(loaded, dc, path, tally)
    if not found:
        raise DataError(f"data.path={path}: no preference pairs ({dict(tally.dropped) or 'no records'})")
    kept = [p for p in (_clean_pair(p, dc, text.control, char_limit, tally) for p in found) if p is not None]
    kept = _dedup_pairs(kept, dc, tally)
    train_pairs, eval_pairs = _split_by_prompt(kept, dc, tally)
    seq_len = text.seq_len(cfg)
    truncated = [0]
    train = _tokenize_pairs(train_pairs, renderer, seq_len, dc, tally, truncated)
    evals = _tokenize_pairs(eval_pairs, renderer, seq_len, dc, tally, truncated, keep_text=True)
    if not train:
        raise DataError(f"no training pairs left after cleaning and the length limit ({dict(tally.dropped)})")
    if eval_pairs and not evals:
        raise DataError(
            f"no held-out pairs left after the length limit (seq_len {seq_len}): raise train.seq_len, "
            "or set data.eval_fraction=0"
        )
    if cfg.train.seq_len == "auto":
        longest = max(
            len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in train + evals
        )
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
    dropped (`eval_leak`)."""
    keys = [clean.conversation_key(p.prompt) for p in kept]
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
        train_keys = [clean.conversation_key(p.prompt) for p in train]
        eval_sorted = sorted(eval_keys)
        sig = (
            clean.Signatures.of(clean.signatures(train_keys + eval_sorted), dc.near_dedup_threshold)
            if dc.near_dedup
            else None
        )
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
) -> list[dict]:
    """Each pair as TRL's token lists: the prompt rendered with the assistant's opening, each answer the
    tokens where prompt + answer departs from it (TRL's own rule, `common_prefix_length`); the length
    limit applied to the prompt plus the longer answer."""
    tok = renderer.tokenizer
    out = []
    for p in found:
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
        row: dict = {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
        if keep_text:
            row["messages"] = json.dumps(p.prompt + p.chosen, ensure_ascii=False)
            row["rejected"] = json.dumps(p.prompt + p.rejected, ensure_ascii=False)
        out.append(row)
    return out


def _pair_stats(
    cfg: Config,
    loaded: sources.Loaded,
    path: str,
    tally: samples.Tally,
    char_limit: int,
    train: list[dict],
    evals: list[dict],
    seq_len: int,
    truncated: int,
) -> dict:
    """data_stats.json's content for pairs: the counts, what was dropped and why, and the lengths of the
    prompt, chosen and rejected sides per split."""
    dc = cfg.data

    def lengths(rows: list[dict]) -> dict:
        return {
            side: stats.summary([len(r[f"{side}_ids"]) for r in rows])
            for side in ("prompt", "chosen", "rejected")
        }

    def pair_tokens(rows: list[dict]) -> list[int]:
        return [len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows]

    return {
        "record_kind": "preferences",
        "num_input": tally.num_input,
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
        "tokens": {
            "train_total": sum(
                2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in train
            ),
            "eval_total": sum(
                2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in evals
            ),
        },
        "seq_len": seq_len,
        "seq_len_source": "auto: the longest kept pair" if cfg.train.seq_len == "auto" else "train.seq_len",
        "input": {"path": path, "fingerprint": None},
        "seconds": None,
    }


# ---------------------------------------------------------------------------------------------------------------
# Prompts with reference answers (GRPO)


@dataclass
class PreparedPrompts:
    """Prompts prepared for GRPO, not yet saved: the conversation up to the answer, and the answer the
    rewards check; eval rows also carry the whole conversation (`messages`, JSON) for generation."""

    stats: dict  # data_stats.json's content
    train: list[dict]  # {prompt: messages, reference: str, prompt_tokens: int}
    evals: list[dict]  # the same, plus `messages`


def prompts(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> PreparedPrompts:
    """Conversation records as GRPO prompts: cleaned, deduplicated and split as SFT's conversations are (so no
    eval prompt is trained on); the last assistant turn is the reference answer; a prompt whose rendering plus
    grpo.max_completion_length cannot fit train.seq_len is dropped (`too_long`)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    text = _TextLimits.of(cfg, tokenizer, "assistant")
    char_limit = text.char_limit
    loaded = sources.Loaded()
    with _streamed(inp, loaded, dc, text, path, tally, scratch, console) as part:
        # GRPO's prompts are held as messages from here on (one a row of the prepared data)
        train_convs = [json.loads(t) for t in part.kept.store.texts(part.train_rows)]
        eval_convs = [json.loads(t) for t in part.kept.store.texts(part.eval_rows)]
    seq_len = text.seq_len(cfg)
    budget = seq_len - cfg.grpo.max_completion_length
    if budget <= 0:
        raise DataError(
            f"train.seq_len={seq_len} leaves no room for a prompt beside grpo.max_completion_length="
            f"{cfg.grpo.max_completion_length}"
        )
    train = _prompt_rows(train_convs, tokenizer, budget, tally, keep_text=False)
    evals = _prompt_rows(eval_convs, tokenizer, budget, tally, keep_text=True)
    if not train:
        raise DataError(f"data.path={path}: no prompts with a reference answer left ({dict(tally.dropped)})")
    longest = max(r["prompt_tokens"] for r in train + evals)
    result = {
        "record_kind": "prompts",
        "num_input": tally.num_input,
        "num_train": len(train),
        "num_eval": len(evals),
        "dropped": {k: v for k, v in sorted(tally.dropped.items()) if v},
        "max_chars": char_limit,
        "control_tokens": {"mode": dc.control_tokens, "samples": tally.with_control},
        "pii": dict(sorted(tally.pii.items())),
        "skipped_files": loaded.empty_files,
        "bad_input_examples": list(sources.iter_where(loaded)),
        # prompt tokens as the chat template renders them with the generation prompt: the rollout's prefill
        "splits": {
            "train": stats.summary([r["prompt_tokens"] for r in train]),
            "eval": stats.summary([r["prompt_tokens"] for r in evals]),
        },
        "tokens": {
            "train_total": sum(r["prompt_tokens"] for r in train),
            "eval_total": sum(r["prompt_tokens"] for r in evals),
        },
        "seq_len": min(seq_len, longest + cfg.grpo.max_completion_length)
        if cfg.train.seq_len == "auto"
        else seq_len,
        "seq_len_source": "auto: the longest prompt + grpo.max_completion_length"
        if cfg.train.seq_len == "auto"
        else "train.seq_len",
        "input": {"path": path, "fingerprint": None},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return PreparedPrompts(result, train, evals)


def _prompt_rows(
    convs: list[Messages], tokenizer: Any, budget: int, tally: samples.Tally, keep_text: bool
) -> list[dict]:
    out = []
    for messages in convs:
        if not messages or messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
            tally.dropped["no_reference"] += 1
            continue
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
        n = len(
            tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        if n > budget:
            tally.dropped["too_long"] += 1
            continue
        row = {"prompt": prompt, "reference": messages[-1]["content"], "prompt_tokens": n}
        if keep_text:
            row["messages"] = json.dumps([*prompt, {"role": "assistant", "content": messages[-1]["content"]}])
        out.append(row)
    return out


# The preparation of each record kind (finetune/core/objectives.py's RECORD_KINDS).
RECORD_KINDS: dict[str, Callable[..., Prepared | PreparedPairs | PreparedPrompts]] = {
    "conversations": conversations,
    "preferences": preferences,
    "prompts": prompts,
}
