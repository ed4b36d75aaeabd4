"""Mapping records to conversations: `messages`, prompt/completion, instruction/input/output (Alpaca), or
plain `text`.

A conversation is a list of `{"role", "content"}` dicts with string content. A `text` record is one message
of the role `TEXT_ROLE`: the renderer writes it as it is, with no chat template, and trains every token.
A record that cannot be mapped (a field missing, a role nobody knows, content
that is not text) raises `RecordError` with a counted reason; the stage turns
it into a located `DataError` or, with data.on_error=skip, a counted skip.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Optional

from finetune.core.config.data import DataConfig

ROLES = ("system", "user", "assistant")
# ShareGPT and friends.
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}

Messages = list[dict[str, str]]

# The role of a plain-text record's one message (`is_text`): no chat turn, no template.
TEXT_ROLE = "text"


def is_text(msgs: Messages) -> bool:
    """A plain-text record (data.format=text), not a conversation."""
    return len(msgs) == 1 and msgs[0]["role"] == TEXT_ROLE


class RecordError(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def detect_format(record: dict, cfg: DataConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    if cfg.messages_field in record or "conversations" in record:
        return "messages"
    if cfg.prompt_field in record and cfg.completion_field in record:
        return "prompt_completion"
    if cfg.instruction_field in record and cfg.output_field in record:
        return "alpaca"
    if cfg.text_field in record:
        return "text"
    names = [str(k) for k in record]
    mapping = (
        f"data.prompt_field={names[0]} data.completion_field={names[1]}"
        if len(names) == 2
        else "data.prompt_field=... data.completion_field=..."
    )
    raise RecordError(
        "missing_field",
        f"no '{cfg.messages_field}', '{cfg.prompt_field}'+'{cfg.completion_field}', "
        f"'{cfg.instruction_field}'+'{cfg.output_field}' or '{cfg.text_field}' field "
        f"(fields: {', '.join(sorted(names)) or 'none'}); name yours with {mapping} "
        "(or data.messages_field, data.text_field)",
    )


def _field(record: dict, key: str, setting: str) -> Any:
    if key not in record or record[key] is None:
        raise RecordError(
            "missing_field", f"missing field '{key}' ({setting}={key}; set it to your field's name)"
        )
    return record[key]


# A lone UTF-16 surrogate ("\ud800" in JSON) is no character: no UTF-8 encoding, no tokenizer takes it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable(text: str, what: str) -> str:
    bad = _SURROGATE.search(text)
    if bad:
        raise RecordError(
            "unencodable_text",
            f"{what} holds a lone surrogate {ascii(bad.group(0))} at character {bad.start()} (not valid Unicode)",
        )
    return text


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return _encodable(value, what)
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):  # [{"type": "text", "text": ...}]
        parts = [p.get("text") for p in value]
        if all(isinstance(p, str) for p in parts):
            return _encodable("".join(p for p in parts if isinstance(p, str)), what)
    raise RecordError("bad_content", f"{what} must be text, got {type(value).__name__}")


def _message(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise RecordError("bad_message", f"message {i} is not an object")
    role = m.get("role", m.get("from"))
    if role is None:
        raise RecordError("missing_field", f"message {i} has no 'role'")
    if not isinstance(role, str):
        raise RecordError("unknown_role", f"message {i} has role {role!r}")
    role = ROLE_ALIASES.get(role.lower(), role.lower())
    if role not in ROLES:
        raise RecordError(
            "unknown_role",
            f"message {i} has unknown role {m.get('role', m.get('from'))!r} (known: {', '.join(ROLES)})",
        )
    content = m.get("content", m.get("value"))
    if content is None:
        raise RecordError("missing_field", f"message {i} has no 'content'")
    return {"role": role, "content": _text(content, f"message {i} content")}


def _messages(value: Any, what: str) -> Messages:
    if isinstance(value, str):  # CSV cells hold JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RecordError("bad_messages", f"'{what}' is neither a list nor JSON text of a list") from None
        except RecursionError:
            raise RecordError(
                "too_deep",
                f"'{what}' holds JSON nested too deeply to read (RecursionError near 1,000 levels)",
            ) from None
    if not isinstance(value, list):
        raise RecordError("bad_messages", f"'{what}' must be a list of messages, got {type(value).__name__}")
    return [_message(m, i) for i, m in enumerate(value)]


def to_messages(record: dict, cfg: DataConfig, formats: Optional[Counter] = None) -> Messages:
    """The record as a conversation (or a text record); `formats` counts the format each record was read as."""
    fmt = detect_format(record, cfg)
    if fmt == "text":
        msgs = [
            {
                "role": TEXT_ROLE,
                "content": _text(_field(record, cfg.text_field, "data.text_field"), cfg.text_field),
            }
        ]
    elif fmt == "messages":
        key = cfg.messages_field if cfg.messages_field in record or cfg.format != "auto" else "conversations"
        msgs = _messages(_field(record, key, "data.messages_field"), key)
    elif fmt == "prompt_completion":
        prompt = _field(record, cfg.prompt_field, "data.prompt_field")
        completion = _field(record, cfg.completion_field, "data.completion_field")
        if isinstance(prompt, list):  # conversational prompt/completion (TRL's format)
            msgs = _messages(prompt, cfg.prompt_field) + _messages(completion, cfg.completion_field)
        else:
            msgs = [
                {"role": "user", "content": _text(prompt, cfg.prompt_field)},
                {"role": "assistant", "content": _text(completion, cfg.completion_field)},
            ]
    else:
        instruction = _text(
            _field(record, cfg.instruction_field, "data.instruction_field"), cfg.instruction_field
        )
        extra = record.get(cfg.input_field) or ""
        extra = _text(extra, cfg.input_field)
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        msgs = [
            {"role": "user", "content": prompt},
            {
                "role": "assistant",
                "content": _text(_field(record, cfg.output_field, "data.output_field"), cfg.output_field),
            },
        ]
    if cfg.system_prompt and fmt != "text" and not (msgs and msgs[0]["role"] == "system"):
        msgs = [{"role": "system", "content": cfg.system_prompt}, *msgs]
    if formats is not None:
        formats[fmt] += 1
    return msgs


def turn_order_problem(msgs: Messages) -> str | None:
    """Why a conversation's turns are out of order, or None: [system] then user/assistant alternating, ending on
    assistant (a text record has no turns)."""
    if not msgs:
        return "no messages"
    if is_text(msgs):
        return None
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    if not body:
        return "only a system message"
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            return f"turn {i + (len(msgs) - len(body))} is {m['role']}, expected {expected}"
    if body[-1]["role"] != "assistant":
        return "does not end with an assistant turn"
    return None
