"""The `prompts` record kind (GRPO): prompts with the reference answer the rewards check, one a row.

Prompts stream as the other record kinds do (`prepare.streamed`), then are read back a batch at a time and held
compactly (`rows.CompactRows`: their JSON text in one buffer, no Python object a prompt) until saved."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import DataError
from finetune.data import rows as saved_rows
from finetune.data import samples, sources, stats
from finetune.data.prepare import TextLimits, batches, streamed
from finetune.data.rows import CompactRows


@dataclass
class PreparedPrompts:
    """Prompts prepared for GRPO, not yet saved: the conversation up to the answer, and the answer the
    rewards check; eval rows also carry the whole conversation (`messages`, JSON) for generation."""

    stats: dict  # data_stats.json's content
    train: CompactRows  # prompt (messages), reference, prompt_tokens (`prompt_rows`)
    evals: CompactRows  # the same, plus `messages`


def prepare(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> PreparedPrompts:
    """Conversation records as GRPO prompts: cleaned, deduplicated and split as SFT's conversations are (so no
    eval prompt is trained on); the last assistant turn is the reference answer; a prompt whose rendering plus
    objective.max_completion_length cannot fit train.seq_len is dropped (`too_long`)."""
    dc = cfg.data
    t0 = time.perf_counter()
    tally = samples.Tally()
    text = TextLimits.of(cfg, tokenizer, "assistant")
    char_limit = text.char_limit
    loaded = sources.Loaded()
    seq_len = text.seq_len(cfg)
    budget = seq_len - cfg.objective.max_completion_length
    if budget <= 0:
        raise DataError(
            f"train.seq_len={seq_len} leaves no room for a prompt beside objective.max_completion_length="
            f"{cfg.objective.max_completion_length}"
        )
    with streamed(inp, loaded, dc, text, path, tally, scratch, console) as part:
        train = _prompt_rows(
            batches(part, part.train_rows, "tokenize"), tokenizer, budget, tally, prompt_rows()
        )
        evals = _prompt_rows(
            batches(part, part.eval_rows, "tokenize"), tokenizer, budget, tally, prompt_rows(True)
        )
    if not len(train):
        raise DataError(f"data.path={path}: no prompts with a reference answer left ({dict(tally.dropped)})")
    train_tokens, eval_tokens = train.values("prompt_tokens"), evals.values("prompt_tokens")
    longest = int(max(train_tokens.max(), eval_tokens.max(initial=0)))
    result = {
        "record_kind": "prompts",
        "num_input": tally.num_input,
        "formats": dict(sorted(loaded.formats.items())),
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
            "train": stats.summary(train_tokens.tolist()),
            "eval": stats.summary(eval_tokens.tolist()),
        },
        "tokens": {"train_total": int(train_tokens.sum()), "eval_total": int(eval_tokens.sum())},
        "seq_len": min(seq_len, longest + cfg.objective.max_completion_length)
        if cfg.train.seq_len == "auto"
        else seq_len,
        "seq_len_source": "auto: the longest prompt + objective.max_completion_length"
        if cfg.train.seq_len == "auto"
        else "train.seq_len",
        "input": {"path": path, "fingerprint": None},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return PreparedPrompts(result, train, evals)


def prompt_rows(keep_text: bool = False) -> CompactRows:
    """GRPO's prompts as its trainer reads them; eval rows also keep the whole conversation (`messages`, JSON)."""
    columns = {"prompt": "messages", "reference": "text", "prompt_tokens": "int"}
    return CompactRows(columns | ({"messages": "text"} if keep_text else {}))


def _prompt_rows(
    texts: Iterable[list[str]], tokenizer: Any, budget: int, tally: samples.Tally, out: CompactRows
) -> CompactRows:
    """Each conversation (batches of JSON texts) as a prompt and its reference answer, appended to `out`."""
    keep_text = "messages" in out.kinds
    for batch in texts:
        for text in batch:
            messages = json.loads(text)
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
                row["messages"] = json.dumps(
                    [*prompt, {"role": "assistant", "content": messages[-1]["content"]}]
                )
            out.append(row)
    return out


def save(prepared: PreparedPrompts, out: Path) -> None:
    """GRPO's prompts, one a row: `prompt` (messages), `reference`, `prompt_tokens`; eval rows also carry the
    whole conversation (`messages`, JSON) for the held-out generation."""
    with saved_rows.quiet_datasets():
        prepared.train.save(out / rundir.DATA_TRAIN_DIR)
        prepared.evals.save(out / rundir.DATA_EVAL_DIR, num_shards=1)
    stats.histogram(
        out / rundir.DATA_HISTOGRAM_FILE,
        {
            "train": prepared.train.values("prompt_tokens").tolist(),
            "eval": prepared.evals.values("prompt_tokens").tolist(),
        },
        int(prepared.stats["seq_len"]),
    )
