"""The `preferences` record kind (DPO): prompt + chosen + rejected, tokenized as TRL's prompt_ids /
chosen_ids / rejected_ids, one pair a row.

Pairs stream as SFT's conversations do (`prepare.streamed`): each record mapped and cleaned as it is read, its
pair's JSON text written to a scratch file, and only a fixed size a pair held (digests, an offset); the split
is by prompt (`samples.split_by_prompt`). The pairs are then read back a batch at a time, tokenized and held
compactly (`rows.CompactRows`: 2 or 4 bytes a token, no Python object a pair) until saved piece by piece
(scripts/measure_data_memory.py measures the bytes a pair costs).
"""

from __future__ import annotations

import json
import time
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
from finetune.data.prepare import Streamed, TextLimits, batches, streamed
from finetune.data.render import Renderer
from finetune.data.rows import CompactRows

SIDES = ("prompt_ids", "chosen_ids", "rejected_ids")
TEXTS = ("messages", "rejected")


def pair_rows(vocab_size: int, keep_text: bool = False) -> CompactRows:
    """Tokenized pairs as TRL reads them (`SIDES`); eval pairs also keep their two conversations' JSON text
    (`TEXTS`: prompt + chosen, for generation; prompt + rejected)."""
    columns = dict.fromkeys(SIDES, "ids") | (dict.fromkeys(TEXTS, "text") if keep_text else {})
    return CompactRows(columns, vocab_size)


def pair_tokens(rows: CompactRows) -> np.ndarray:
    """Each pair's longer side: prompt plus the longer answer."""
    return rows.lengths("prompt_ids") + np.maximum(rows.lengths("chosen_ids"), rows.lengths("rejected_ids"))


@dataclass
class PreparedPairs:
    """Preference pairs prepared for DPO, not yet saved: TRL's token ids per pair (`pair_rows`), train then eval
    (which also keeps `messages`: prompt + chosen, JSON, and `rejected`: prompt + rejected, JSON)."""

    stats: dict  # data_stats.json's content
    train: CompactRows
    evals: CompactRows


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
    loaded = sources.Loaded()

    def to_samples(data: dict) -> list[samples.Candidate]:
        pair = _clean_pair(pairs.to_pair(data, dc), dc, text.control, text.char_limit, tally)
        if pair is None:
            return []
        as_json = json.dumps([pair.prompt, pair.chosen, pair.rejected], ensure_ascii=False)
        return [(as_json, _pair_key(pair), clean.prompt_key(pair.prompt))]

    seq_len = text.seq_len(cfg)
    truncated = [0]
    with streamed(inp, loaded, dc, text, path, tally, scratch, console, to_samples, by_prompt=True) as part:
        if not len(part.kept):
            raise DataError(f"data.path={path}: no preference pairs ({dict(tally.dropped) or 'no records'})")
        had_eval = bool(len(part.eval_rows))
        vocab = len(tokenizer)
        train = _tokenize_pairs(
            _read_back(part, part.train_rows), text.renderer, seq_len, dc, tally, truncated, pair_rows(vocab)
        )
        evals = _tokenize_pairs(
            _read_back(part, part.eval_rows),
            text.renderer,
            seq_len,
            dc,
            tally,
            truncated,
            pair_rows(vocab, True),
        )
    if not len(train):
        raise DataError(f"no training pairs left after cleaning and the length limit ({dict(tally.dropped)})")
    if had_eval and not len(evals):
        raise DataError(
            f"no held-out pairs left after the length limit (seq_len {seq_len}): raise train.seq_len, "
            "or set data.eval_fraction=0"
        )
    if cfg.train.seq_len == "auto":
        longest = max(int(pair_tokens(rows).max()) for rows in (train, evals) if len(rows))
        seq_len = min(seq_len, longest)
    result = _pair_stats(cfg, loaded, path, tally, text.char_limit, train, evals, seq_len, truncated[0])
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return PreparedPairs(result, train, evals)


def _read_back(part: Streamed, rows: Any) -> Iterator[pairs.Pair]:
    """The kept pairs of `rows`, read back from the scratch file a batch at a time."""
    for batch in batches(part, rows, "tokenize"):
        for text in batch:
            prompt, chosen, rejected = json.loads(text)
            yield pairs.Pair(prompt, chosen, rejected)


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


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _tokenize_pairs(
    found: Iterable[pairs.Pair],
    renderer: Renderer,
    seq_len: int,
    dc: DataConfig,
    tally: samples.Tally,
    truncated: list[int],
    out: CompactRows,
) -> CompactRows:
    """Each pair as TRL's token ids, appended to `out`: the prompt rendered with the assistant's opening, each
    answer the tokens where prompt + answer departs from it (TRL's own rule, `common_prefix_length`); the
    length limit applied to the prompt plus the longer answer."""
    tok = renderer.tokenizer
    keep_text = "messages" in out.kinds
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
        row = dict(zip(SIDES, (prompt_ids, chosen_ids, rejected_ids)))
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
    train: CompactRows,
    evals: CompactRows,
    seq_len: int,
    truncated: int,
) -> dict:
    """data_stats.json's content for pairs: the counts, what was dropped and why, and the lengths of the
    prompt, chosen and rejected sides per split."""
    dc = cfg.data

    def lengths(rows: CompactRows) -> dict:
        return {
            side: stats.summary(rows.lengths(f"{side}_ids").tolist())
            for side in ("prompt", "chosen", "rejected")
        }

    def total(rows: CompactRows) -> int:
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
        "splits": {
            "train": stats.summary(pair_tokens(train).tolist()),
            "eval": stats.summary(pair_tokens(evals).tolist()),
        },
        "tokens": {"train_total": total(train), "eval_total": total(evals)},
        "seq_len": seq_len,
        "seq_len_source": "auto: the longest kept pair" if cfg.train.seq_len == "auto" else "train.seq_len",
        "input": {"path": path, "fingerprint": None},
        "seconds": None,
    }


def save(prepared: PreparedPairs, out: Path) -> None:
    """Preference pairs, one a row (TRL's prompt_ids, chosen_ids, rejected_ids); eval rows also carry the
    prompt + chosen conversation (`messages`, for generation from the prompt) and prompt + rejected."""
    with saved_rows.quiet_datasets():
        prepared.train.save(out / rundir.DATA_TRAIN_DIR)
        prepared.evals.save(out / rundir.DATA_EVAL_DIR, num_shards=1)
    lengths = prepared.stats["splits"]
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {"train": pair_tokens(prepared.train).tolist(), "eval": pair_tokens(prepared.evals).tolist()},
        int(prepared.stats["seq_len"]) or max(1, lengths["train"]["max"]),
    )
