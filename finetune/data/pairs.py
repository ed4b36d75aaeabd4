"""Preference records to pairs: a prompt, a chosen and a rejected answer, each a list of messages.

Accepted shapes (TRL's preference formats): `prompt` + `chosen` + `rejected` as plain strings or as
message lists (conversational), and `chosen` + `rejected` alone as whole conversations sharing a prefix,
which is the prompt. A record that cannot be mapped raises `RecordError` with a counted reason, located
by file and line by the caller. A pair is a prompt and two answers that differ; the prompt ends on a user
turn and each answer is assistant turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.core.config.data import DataConfig
from finetune.data.formats import Messages, RecordError, _field, _messages, _text


@dataclass
class Pair:
    prompt: Messages
    chosen: Messages
    rejected: Messages

    def sides(self) -> tuple[Messages, Messages]:
        """The two whole conversations: prompt + chosen, prompt + rejected."""
        return self.prompt + self.chosen, self.prompt + self.rejected


def _side(value: Any, what: str, role: str) -> Messages:
    if isinstance(value, list):
        return _messages(value, what)
    return [{"role": role, "content": _text(value, what)}]


def _common_prefix(a: Messages, b: Messages) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def to_pair(record: dict, cfg: DataConfig) -> Pair:
    """One record as a `Pair`, or `RecordError` naming what is wrong."""
    chosen_raw = _field(record, cfg.chosen_field, "data.chosen_field")
    rejected_raw = _field(record, cfg.rejected_field, "data.rejected_field")
    if cfg.prompt_field in record and record[cfg.prompt_field] is not None:
        prompt = _side(record[cfg.prompt_field], cfg.prompt_field, "user")
        chosen = _side(chosen_raw, cfg.chosen_field, "assistant")
        rejected = _side(rejected_raw, cfg.rejected_field, "assistant")
    else:  # two whole conversations: the prompt is their common prefix
        whole_c = _messages(chosen_raw, cfg.chosen_field)
        whole_r = _messages(rejected_raw, cfg.rejected_field)
        n = _common_prefix(whole_c, whole_r)
        # The prefix ends before the first assistant turn that differs.
        while n > 0 and whole_c[n - 1]["role"] == "assistant" and (n >= len(whole_c) or n >= len(whole_r)):
            n -= 1
        if n == 0:
            raise RecordError(
                "no_shared_prompt",
                f"no '{cfg.prompt_field}' field and '{cfg.chosen_field}' and '{cfg.rejected_field}' share no prefix",
            )
        prompt, chosen, rejected = whole_c[:n], whole_c[n:], whole_r[n:]
    if cfg.system_prompt and not (prompt and prompt[0]["role"] == "system"):
        prompt = [{"role": "system", "content": cfg.system_prompt}, *prompt]
    if not prompt or prompt[-1]["role"] != "user":
        raise RecordError("bad_prompt", f"the prompt must end with a user turn ('{cfg.prompt_field}')")
    for side, what in ((chosen, cfg.chosen_field), (rejected, cfg.rejected_field)):
        if not side:
            raise RecordError("empty_side", f"'{what}' holds no answer beyond the prompt")
        if any(m["role"] != "assistant" for m in side):
            raise RecordError("bad_answer", f"'{what}' must hold assistant turns only after the prompt")
    if same_answer(chosen, rejected):
        raise RecordError(
            "identical_pair",
            f"'{cfg.chosen_field}' and '{cfg.rejected_field}' are the same answer (up to whitespace)",
        )
    return Pair(prompt, chosen, rejected)


def same_answer(a: list[dict], b: list[dict]) -> bool:
    """The same turns but for whitespace: no preference to learn between them (the model would be taught
    a spacing, or the difference of tokenizations of the same text)."""

    def words(side: list[dict]) -> list[tuple[object, str]]:
        return [(m.get("role"), " ".join(str(m.get("content", "")).split())) for m in side]

    return words(a) == words(b)
