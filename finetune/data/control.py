"""Control tokens inside message content: `data.control_tokens=drop|escape|keep`.

Scraped chat logs carry strings such as `<|end|>\\n<|user|>` inside a message. A
tokenizer turns its special tokens into control tokens wherever they appear, so
such content would forge turn boundaries (and, in assistant content, train the
model to emit them). The markers looked for are every special token of the
tokenizer and the tag-shaped pieces (`<...>`, `<|...|>`, `[INST]`-style) of the
text the chat template writes around messages, which matter where a template's
markers are plain text rather than tokens.

- drop (default): the sample is dropped, counted as `control_tokens` in data_stats.json;
- escape: a ZERO WIDTH SPACE goes after each marker's first character, so it reads the
  same and tokenizes as plain text;
- keep: left as is (the old behaviour; still counted).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from finetune.data.formats import Messages

ESCAPE = "\u200b"  # ZERO WIDTH SPACE
# Tag-shaped pieces of template text: <|user|>, <start_of_turn>, </s>, [INST], [/INST].
_TAG = re.compile(r"<\|[^\s<>|]{1,40}\|>|</?[A-Za-z_][^\s<>]{0,40}>|\[/?[A-Z][A-Z_]{1,20}\]")


def special_tokens(tokenizer: Any) -> set[str]:
    """Every special token: the named ones and the added tokens flagged special (Llama 3's reserved ones)."""
    found = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    return {t for t in found if t}


def template_markers(template_texts: list[str]) -> set[str]:
    """The tag-shaped pieces of the text a template writes between, before and after messages."""
    return {m.group(0) for text in template_texts for m in _TAG.finditer(text)}


class ControlTokens:
    """Finds and escapes markers in content; `pattern` is None when there are none to look for."""

    def __init__(self, markers: set[str]):
        self.markers = sorted(markers, key=lambda m: (-len(m), m))
        self.pattern: Optional[re.Pattern] = (
            re.compile("|".join(re.escape(m) for m in self.markers)) if self.markers else None
        )
        self._first = {m[0] for m in self.markers}

    def found(self, text: str) -> bool:
        if self.pattern is None or not any(ch in text for ch in self._first):
            return False
        return self.pattern.search(text) is not None

    def escape(self, text: str) -> str:
        if self.pattern is None:
            return text
        return self.pattern.sub(lambda m: m.group(0)[0] + ESCAPE + m.group(0)[1:], text)

    def in_messages(self, msgs: Messages) -> bool:
        return any(self.found(m["content"]) for m in msgs)

    def escape_messages(self, msgs: Messages) -> Messages:
        return [{**m, "content": self.escape(m["content"])} for m in msgs]
