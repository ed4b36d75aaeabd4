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
from typing import Any, Optional

import numpy as np

from finetune import rundir
from finetune.core.config import Config
from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data import clean, pairs, samples, sources, stats
from finetune.data import rows as saved_rows
from finetune.data.control import ControlTokens
from finetune.data.formats import Messages, RecordError, _field, _messages, _text
from finetune.data.prepare import Streamed, TextLimits, batches, streamed
from finetune.data.render import Renderer
from finetune.data.rows import CompactRows


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
    train: CompactRows  # prompt_ids, completion_ids, label (`example_rows`)
    evals: (
        CompactRows  # the same, plus `messages` (JSON: prompt + completion where desirable, else the prompt)
    )


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
    data.too_long=truncate). They stream as the other record kinds do (`prepare.streamed`): a fixed size an
    example held until tokenized, then its tokens compactly (`rows.CompactRows`)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    text = TextLimits.of(cfg, tokenizer, "assistant")
    loaded = sources.Loaded()

    def to_samples(data: dict) -> list[samples.Candidate]:
        out = []
        for example in to_examples(data, dc):
            e = _clean(example, dc, text.control, text.char_limit, tally)
            if e is not None:
                as_json = json.dumps([e.prompt, e.completion, e.label], ensure_ascii=False)
                out.append((as_json, _key(e), clean.prompt_key(e.prompt)))
        return out

    seq_len = text.seq_len(cfg)
    truncated = [0]
    with streamed(inp, loaded, dc, text, path, tally, scratch, console, to_samples, by_prompt=True) as part:
        if not len(part.kept):
            raise DataError(f"data.path={path}: no labelled examples ({dict(tally.dropped) or 'no records'})")
        had_eval = bool(len(part.eval_rows))
        vocab = len(tokenizer)
        train = _tokenize(
            _read_back(part, part.train_rows, dc),
            text.renderer,
            seq_len,
            dc,
            tally,
            truncated,
            example_rows(vocab),
        )
        evals = _tokenize(
            _read_back(part, part.eval_rows, dc),
            text.renderer,
            seq_len,
            dc,
            tally,
            truncated,
            example_rows(vocab, True),
        )
    if not len(train):
        raise DataError(
            f"no training examples left after cleaning and the length limit ({dict(tally.dropped)})"
        )
    if had_eval and not len(evals):
        raise DataError(
            f"no held-out examples left after the length limit (seq_len {seq_len}): raise train.seq_len, "
            "or set data.eval_fraction=0"
        )
    if cfg.train.seq_len == "auto":
        seq_len = min(seq_len, max(int(_tokens(rows).max()) for rows in (train, evals) if len(rows)))
    result = _stats(cfg, loaded, path, tally, text.char_limit, train, evals, seq_len, truncated[0])
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return PreparedExamples(result, train, evals)


def example_rows(vocab_size: int, keep_text: bool = False) -> CompactRows:
    """Tokenized examples as TRL reads them; eval rows also keep `messages` (JSON: prompt + completion where
    desirable, else the prompt)."""
    columns = {"prompt_ids": "ids", "completion_ids": "ids", "label": "flag"}
    return CompactRows(columns | ({"messages": "text"} if keep_text else {}), vocab_size)


def _read_back(part: Streamed, rows: Any, dc: DataConfig) -> Iterator[Example]:
    """The kept examples of `rows` in the seed's order (`_ordered`), read back from the scratch file a batch at
    a time."""
    for batch in batches(part, _ordered(part, rows, dc), "tokenize"):
        for text in batch:
            prompt, completion, label = json.loads(text)
            yield Example(prompt, completion, label)


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


def _ordered(part: Streamed, rows: Any, dc: DataConfig) -> np.ndarray:
    """`rows` by the SHA-1 of data.seed and the example: a fixed order in which a prompt's examples are not
    neighbours but by chance (TRL's KL estimate takes each completion to its neighbour's prompt). The digests
    are made in a pass over the examples' texts, 20 bytes a row held."""
    digests = bytearray()
    for i in range(0, len(rows), samples._BATCH):
        for text in part.kept.store.texts(rows[i : i + samples._BATCH]):
            prompt, completion, label = json.loads(text)
            digests.extend(
                hashlib.sha1(f"{dc.seed}:{_key(Example(prompt, completion, label))}".encode()).digest()
            )
    order = np.argsort(np.frombuffer(bytes(digests), dtype="S20"), kind="stable")
    return np.asarray(rows)[order]


def _tokens(rows: CompactRows) -> np.ndarray:
    """Each example's tokens: prompt plus completion."""
    return rows.lengths("prompt_ids") + rows.lengths("completion_ids")


def _tokenize(
    found: Iterable[Example],
    renderer: Renderer,
    seq_len: int,
    dc: DataConfig,
    tally: samples.Tally,
    truncated: list[int],
    out: CompactRows,
) -> CompactRows:
    """Each example as TRL's token lists, appended to `out`: the prompt rendered with the assistant's opening,
    the completion the tokens where prompt + completion departs from it (TRL's `common_prefix_length` rule);
    the length limit on the two together."""
    tok = renderer.tokenizer
    keep_text = "messages" in out.kinds
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
    train: CompactRows,
    evals: CompactRows,
    seq_len: int,
    truncated: int,
) -> dict:
    """data_stats.json's content for labelled examples: the counts, desirable and undesirable per split, what
    was dropped and why, and the prompt and completion lengths per split."""
    dc = cfg.data

    def labels(rows: CompactRows) -> dict:
        desirable = int(rows.values("label").sum())
        return {"desirable": desirable, "undesirable": len(rows) - desirable}

    def lengths(rows: CompactRows) -> dict:
        return {
            side: stats.summary(rows.lengths(f"{side}_ids").tolist()) for side in ("prompt", "completion")
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
            "train": stats.summary(_tokens(train).tolist()),
            "eval": stats.summary(_tokens(evals).tolist()),
        },
        "tokens": {"train_total": int(_tokens(train).sum()), "eval_total": int(_tokens(evals).sum())},
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
    with saved_rows.quiet_datasets():
        prepared.train.save(out / rundir.DATA_TRAIN_DIR)
        prepared.evals.save(out / rundir.DATA_EVAL_DIR, num_shards=1)
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {"train": _tokens(prepared.train).tolist(), "eval": _tokens(prepared.evals).tolist()},
        int(prepared.stats["seq_len"]) or max(1, prepared.stats["splits"]["train"]["max"]),
    )
