"""User text rendered safely: every place that puts a name, path, value, prompt or model answer into
Markdown, a rich console line or a plot goes through these functions, so it shows as the text it is.

Text from the data, the model or the command line may hold HTML (`<img src=x onerror=...>` runs in a
Markdown viewer that renders HTML), Markdown syntax (a `|` ends a table cell, a newline ends the row,
`[text](url)` makes a link), rich markup (`[/]` raised MarkupError, `[red]` vanished) or terminal
control sequences (ESC codes rewrite the screen). JSON outputs (`samples.jsonl`, `metrics.json`) stay
raw: they are data, not rendered.
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls other than tab and newline, DEL, and the C1 controls (ESC starts terminal sequences).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Markdown's inline syntax that changes what a cell shows: code spans, emphasis, links and images,
# strikethrough, the backslash itself, and `|`, which ends a table cell.
_MARKDOWN = re.compile(r"([\\`*\[\]~|])")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def markdown_text(value: Any) -> str:
    """`value` as literal text on one Markdown line: HTML escaped (`<>&`), Markdown syntax and `|`
    backslash-escaped, newlines and other control characters folded into single spaces."""
    text = " ".join(_CONTROL.sub(" ", _text(value)).split())
    text = _MARKDOWN.sub(r"\\\1", text)
    return "".join(_HTML.get(c, c) for c in text)


def markdown_cell(value: Any, width: int = 0) -> str:
    """`markdown_text` for a table cell, cut to `width` characters of the text (0: whole) with an ellipsis.

    The text is cut before it is escaped, so an escape sequence is never split."""
    text = " ".join(_CONTROL.sub(" ", _text(value)).split())
    if width and len(text) > width:
        text = text[: width - 1] + "…"
    return markdown_text(text)


def terminal_text(value: Any) -> str:
    """`value` for a plain terminal line (print, logs): control characters (ESC sequences, carriage
    returns, backspaces) shown as `?`; newlines and tabs kept."""
    return _CONTROL.sub("?", _text(value))


def terminal_line(value: Any) -> str:
    """`terminal_text` on one line (an error message): newlines and tabs become spaces, so a name holding
    a newline cannot split the one line a refusal prints."""
    return " ".join(terminal_text(value).replace("\t", " ").splitlines())


def console_text(value: Any) -> str:
    """`value` for rich's console (`console.print`, table cells): `terminal_text`, with rich markup
    escaped so brackets show as brackets."""
    from rich.markup import escape

    return escape(terminal_text(value))


def plot_text(value: Any) -> str:
    """`value` for a matplotlib label: `$` escaped (two of them start mathtext, which can fail to parse)."""
    return terminal_text(value).replace("$", r"\$")
