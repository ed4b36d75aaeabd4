"""The `prompts` record kind (GRPO): prompts with the reference answer the rewards check, one a row."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import DataError
from finetune.data import rows as saved_rows
from finetune.data import samples, sources, stats
from finetune.data.formats import Messages
from finetune.data.prepare import TextLimits, streamed


@dataclass
class PreparedPrompts:
    """Prompts prepared for GRPO, not yet saved: the conversation up to the answer, and the answer the
    rewards check; eval rows also carry the whole conversation (`messages`, JSON) for generation."""

    stats: dict  # data_stats.json's content
    train: list[dict]  # {prompt: messages, reference: str, prompt_tokens: int}
    evals: list[dict]  # the same, plus `messages`


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
    with streamed(inp, loaded, dc, text, path, tally, scratch, console) as part:
        # GRPO's prompts are held as messages from here on (one a row of the prepared data)
        train_convs = [json.loads(t) for t in part.kept.store.texts(part.train_rows)]
        eval_convs = [json.loads(t) for t in part.kept.store.texts(part.eval_rows)]
    seq_len = text.seq_len(cfg)
    budget = seq_len - cfg.objective.max_completion_length
    if budget <= 0:
        raise DataError(
            f"train.seq_len={seq_len} leaves no room for a prompt beside objective.max_completion_length="
            f"{cfg.objective.max_completion_length}"
        )
    train = _prompt_rows(train_convs, tokenizer, budget, tally, keep_text=False)
    evals = _prompt_rows(eval_convs, tokenizer, budget, tally, keep_text=True)
    if not train:
        raise DataError(f"data.path={path}: no prompts with a reference answer left ({dict(tally.dropped)})")
    longest = max(r["prompt_tokens"] for r in train + evals)
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
            "train": stats.summary([r["prompt_tokens"] for r in train]),
            "eval": stats.summary([r["prompt_tokens"] for r in evals]),
        },
        "tokens": {
            "train_total": sum(r["prompt_tokens"] for r in train),
            "eval_total": sum(r["prompt_tokens"] for r in evals),
        },
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


def save(prepared: PreparedPrompts, out: Path) -> None:
    """GRPO's prompts, one a row: `prompt` (messages), `reference`, `prompt_tokens`; eval rows also carry the
    whole conversation (`messages`, JSON) for the held-out generation."""
    from datasets import Dataset

    with saved_rows.quiet_datasets():
        columns = ("prompt", "reference", "prompt_tokens")
        Dataset.from_dict({c: [r[c] for r in prepared.train] for c in columns}).save_to_disk(
            str(out / rundir.DATA_TRAIN_DIR)
        )
        evals = {c: [r[c] for r in prepared.evals] for c in (*columns, "messages")}
        Dataset.from_dict(evals).save_to_disk(str(out / rundir.DATA_EVAL_DIR), num_shards=1)
        stats.histogram(
            out / rundir.DATA_HISTOGRAM_FILE,
            {
                "train": [r["prompt_tokens"] for r in prepared.train],
                "eval": [r["prompt_tokens"] for r in prepared.evals],
            },
            int(prepared.stats["seq_len"]),
        )
