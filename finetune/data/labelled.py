"""The `labelled` record kind (KTO): prompt + completion + label, tokenized as TRL's prompt_ids / completion_ids /
label, one example a row.

Accepted shapes (TRL's unpaired preference format): `prompt` + `completion` as plain strings or message lists,
with `label` true (a desirable completion) or false; and preference pairs (`prompt` + `chosen` + `rejected`),
each of which becomes a desirable and an undesirable example, as TRL unpairs them. The rows are ordered by the
SHA-1 of data.seed and the example, not as read: TRL's KL estimate pairs each prompt with its neighbour's
completion in the batch, so neighbours must not share a prompt (a file of unpaired pairs would put them side by
side).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

from finetune import rundir
from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data import clean, pairs, samples, sources, stats
from finetune.data import rows as saved_rows
from finetune.data.control import ControlTokens
from finetune.data.formats import Messages, RecordError, _field, _messages, _text
from finetune.data.preferences import _split_by_prompt
from finetune.data.prepare import TextLimits, progress, records
from finetune.data.render import Renderer


@dataclass
class Example:
    """One unpaired example: a prompt ending on a user turn, an answer of assistant turns, and its label."""

    prompt: Messages
    completion: Messages
    label: bool

    def whole(self) -> Messages:
        return self.prompt + self.completion


@dataclass
class PreparedExamples:
    """Labelled examples prepared for KTO, not yet saved: TRL's token lists per example, train then eval."""

    stats: dict  # data_stats.json's content
    train: list[dict]  # {prompt_ids, completion_ids, label}
    evals: list[
        dict
    ]  # the same, plus `messages` (JSON: prompt + completion where desirable, else the prompt)


def _label(value: Any, dc: DataConfig) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise RecordError(
        "bad_label",
        f"'{dc.label_field}' must be true (desirable) or false, got {value!r} (data.label_field={dc.label_field})",
    )


def _side(value: Any, what: str, role: str) -> Messages:
    if isinstance(value, list):
        return _messages(value, what)
    return [{"role": role, "content": _text(value, what)}]


def to_examples(record: dict, dc: DataConfig) -> list[Example]:
    """One record as its examples (a pair is two), or `RecordError` naming what is wrong."""
    if dc.completion_field not in record and dc.chosen_field in record:
        pair = pairs.to_pair(record, dc)
        return [Example(pair.prompt, pair.chosen, True), Example(pair.prompt, pair.rejected, False)]
    prompt = _side(_field(record, dc.prompt_field, "data.prompt_field"), dc.prompt_field, "user")
    completion = _side(
        _field(record, dc.completion_field, "data.completion_field"), dc.completion_field, "assistant"
    )
    label = _label(_field(record, dc.label_field, "data.label_field"), dc)
    if dc.system_prompt and not (prompt and prompt[0]["role"] == "system"):
        prompt = [{"role": "system", "content": dc.system_prompt}, *prompt]
    if not prompt or prompt[-1]["role"] != "user":
        raise RecordError("bad_prompt", f"the prompt must end with a user turn ('{dc.prompt_field}')")
    if not completion or any(m["role"] != "assistant" for m in completion):
        raise RecordError("bad_answer", f"'{dc.completion_field}' must hold assistant turns only")
    return [Example(prompt, completion, label)]


def prepare(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> PreparedExamples:
    """Labelled records prepared for KTO: mapped to examples (bad ones located), cleaned as SFT's conversations
    are, deduplicated, split by prompt (no prompt of an eval example is trained on), ordered by the seed,
    tokenized with the chat template, and held to the length limit (dropped, or the completion cut with
    data.too_long=truncate)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    text = TextLimits.of(cfg, tokenizer, "assistant")
    loaded = sources.Loaded()
    del scratch  # examples are held in memory, as read
    with progress(console) as bar:
        found = list(_read(records(inp, loaded, bar), loaded, dc))
    samples.check_input(loaded, dc, path, tally)
    if not found:
        raise DataError(f"data.path={path}: no labelled examples ({dict(tally.dropped) or 'no records'})")
    kept = [e for e in (_clean(e, dc, text.control, text.char_limit, tally) for e in found) if e is not None]
    kept = _dedup(kept, dc, tally)
    # DPO's split by prompt, on anything with a `prompt` (typed for its pairs)
    train_examples, eval_examples = cast(Any, _split_by_prompt)(kept, dc, tally)
    seq_len = text.seq_len(cfg)
    truncated = [0]
    train = _tokenize(_ordered(train_examples, dc), text.renderer, seq_len, dc, tally, truncated)
    evals = _tokenize(_ordered(eval_examples, dc), text.renderer, seq_len, dc, tally, truncated, True)
    if not train:
        raise DataError(
            f"no training examples left after cleaning and the length limit ({dict(tally.dropped)})"
        )
    if eval_examples and not evals:
        raise DataError(
            f"no held-out examples left after the length limit (seq_len {seq_len}): raise train.seq_len, "
            "or set data.eval_fraction=0"
        )
    if cfg.train.seq_len == "auto":
        seq_len = min(seq_len, max(_tokens(r) for r in train + evals))
    result = _stats(cfg, loaded, path, tally, text.char_limit, train, evals, seq_len, truncated[0])
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return PreparedExamples(result, train, evals)


def _read(found: Iterable[sources.Record], loaded: sources.Loaded, dc: DataConfig) -> Iterator[Example]:
    """The records as they are read, mapped to examples; one that cannot be is bad input, counted in `loaded`."""
    for rec in found:
        try:
            yield from to_examples(rec.data, dc)
        except RecordError as exc:
            loaded.add_bad(sources.BadRecord(rec.source, rec.line, exc.reason, str(exc)))


def _clean(
    example: Example, dc: DataConfig, control: ControlTokens, char_limit: int, tally: samples.Tally
) -> Optional[Example]:
    """Cleaned as SFT's conversations (empty turns, turn order, characters, control tokens, PII), or None."""
    n = len(example.prompt)
    cleaned = samples.clean_sample(example.whole(), dc, control, char_limit, tally)
    if cleaned is None or len(cleaned) <= n:
        if cleaned is not None:  # truncated into the prompt: no answer left
            tally.dropped["too_long_chars"] += 1
        return None
    return Example(cleaned[:n], cleaned[n:], example.label)


def _key(example: Example) -> str:
    return clean.conversation_key(example.whole() + [{"role": "-", "content": str(example.label)}])


def _dedup(kept: list[Example], dc: DataConfig, tally: samples.Tally) -> list[Example]:
    """Exact duplicate examples out (data.dedup), the label included; a completion may be both, on two rows."""
    if not dc.dedup:
        return kept
    seen: set[bytes] = set()
    out = []
    for e in kept:
        h = clean.exact_digest(_key(e))
        if h in seen:
            tally.dropped["duplicate"] += 1
            continue
        seen.add(h)
        out.append(e)
    return out


def _ordered(examples: list[Example], dc: DataConfig) -> list[Example]:
    """By the SHA-1 of data.seed and the example: a fixed order in which a prompt's examples are not neighbours
    but by chance (TRL's KL estimate takes each completion to its neighbour's prompt)."""
    return sorted(examples, key=lambda e: hashlib.sha1(f"{dc.seed}:{_key(e)}".encode()).digest())


def _tokens(row: dict) -> int:
    return len(row["prompt_ids"]) + len(row["completion_ids"])


def _tokenize(
    found: list[Example],
    renderer: Renderer,
    seq_len: int,
    dc: DataConfig,
    tally: samples.Tally,
    truncated: list[int],
    keep_text: bool = False,
) -> list[dict]:
    """Each example as TRL's token lists: the prompt rendered with the assistant's opening, the completion the
    tokens where prompt + completion departs from it (TRL's `common_prefix_length` rule); the length limit on
    the two together."""
    tok = renderer.tokenizer
    out = []
    for e in found:
        prompt_ids = tok(renderer.text(e.prompt, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        whole = tok(renderer.text(e.whole()), add_special_tokens=False)["input_ids"]
        start = 0
        while start < min(len(prompt_ids), len(whole)) and prompt_ids[start] == whole[start]:
            start += 1
        prompt_ids, completion_ids = prompt_ids[:start], whole[start:]
        if not completion_ids:
            tally.dropped["empty_answer_tokens"] += 1
            continue
        if len(whole) < dc.min_tokens:
            tally.dropped["too_short"] += 1
            continue
        if len(whole) > seq_len:
            if dc.too_long == "drop" or start >= seq_len:
                tally.dropped["too_long" if dc.too_long == "drop" else "prompt_too_long"] += 1
                continue
            completion_ids = completion_ids[: seq_len - start]
            truncated[0] += 1
        row: dict = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "label": e.label}
        if keep_text:
            # Generation is scored against desirable answers only: an undesirable row holds its prompt alone.
            row["messages"] = json.dumps(e.whole() if e.label else e.prompt, ensure_ascii=False)
        out.append(row)
    return out


def _stats(
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
    """data_stats.json's content for labelled examples: the counts, desirable and undesirable per split, what
    was dropped and why, and the prompt and completion lengths per split."""
    dc = cfg.data

    def labels(rows: list[dict]) -> dict:
        desirable = sum(1 for r in rows if r["label"])
        return {"desirable": desirable, "undesirable": len(rows) - desirable}

    def lengths(rows: list[dict]) -> dict:
        return {
            side: stats.summary([len(r[f"{side}_ids"]) for r in rows]) for side in ("prompt", "completion")
        }

    return {
        "record_kind": "labelled",
        "num_input": tally.num_input,
        "formats": dict(sorted(loaded.formats.items())),
        "num_train": len(train),
        "num_eval": len(evals),
        "labels": {"train": labels(train), "eval": labels(evals)},
        "dropped": {k: v for k, v in sorted(tally.dropped.items()) if v},
        "truncated": truncated,
        "max_chars": char_limit,
        "control_tokens": {"mode": dc.control_tokens, "samples": tally.with_control},
        "pii": dict(sorted(tally.pii.items())),
        "skipped_files": loaded.empty_files,
        "bad_input_examples": list(sources.iter_where(loaded)),
        "lengths": {"train": lengths(train), "eval": lengths(evals)},
        "splits": {
            "train": stats.summary([_tokens(r) for r in train]),
            "eval": stats.summary([_tokens(r) for r in evals]),
        },
        "tokens": {"train_total": sum(map(_tokens, train)), "eval_total": sum(map(_tokens, evals))},
        "seq_len": seq_len,
        "seq_len_source": "auto: the longest kept example"
        if cfg.train.seq_len == "auto"
        else "train.seq_len",
        "input": {"path": path, "fingerprint": None},
        "seconds": None,
    }


def save(prepared: PreparedExamples, out: Path) -> None:
    """Labelled examples, one a row (TRL's prompt_ids, completion_ids, label); eval rows also carry `messages`
    (the conversation to generate from, ending in the desirable answer, or the prompt alone)."""
    from datasets import Dataset

    with saved_rows.quiet_datasets():
        columns = ("prompt_ids", "completion_ids", "label")
        train = {c: [r[c] for r in prepared.train] for c in columns}
        Dataset.from_dict(train).save_to_disk(str(out / rundir.DATA_TRAIN_DIR))
        evals = {c: [r[c] for r in prepared.evals] for c in (*columns, "messages")}
        Dataset.from_dict(evals).save_to_disk(str(out / rundir.DATA_EVAL_DIR), num_shards=1)
        stats.histogram(
            out / rundir.DATA_HISTOGRAM_FILE,
            {"train": [_tokens(r) for r in prepared.train], "eval": [_tokens(r) for r in prepared.evals]},
            int(prepared.stats["seq_len"]) or max(1, prepared.stats["splits"]["train"]["max"]),
        )
