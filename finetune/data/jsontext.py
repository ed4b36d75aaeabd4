"""A JSON file's text streamed in chunks (`JsonText`), for reading the items of a top-level array one at a
time: a value is found by its brackets and quotes alone, then parsed by the C decoder, so memory holds about
one item and one chunk, and a value nested far too deeply costs a scan, not a recursion."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import Any, BinaryIO, Optional

CHUNK = 1 << 20  # bytes read at a time, and between two progress updates
Advance = Callable[[int], None]  # progress: bytes (files) or rows (a data set) just read

_NOT_SPACE = re.compile(r"[^ \t\n\r]")
_STRUCTURE = re.compile(r'["\[\]{}]')
_STRING_END = re.compile(r'["\\]')
_SCALAR_END = re.compile(r"[,\]}\s]")
_DECODER = json.JSONDecoder()


class JsonText:
    """A (UTF-8 checked) JSON file's text read in chunks: `buf[pos:]` is unread, `line` the line at `pos`.
    What is consumed is dropped at the next read, so memory holds about one item and one chunk."""

    def __init__(self, f: BinaryIO, advance: Advance):
        self._f, self._advance = f, advance
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf, self.pos, self.line, self.eof = "", 0, 1, False

    def _fill(self) -> bool:
        """One more chunk into the buffer (the consumed part dropped); False at the end of the file."""
        if self.eof:
            return False
        data = self._f.read(CHUNK)
        self._advance(len(data))
        self.buf = self.buf[self.pos :] + self._decoder.decode(data, final=not data)
        self.pos = 0
        self.eof = not data
        return True

    def peek(self) -> str:
        """The next character that is not white space ('' at the end), `pos` moved to it."""
        while True:
            m = _NOT_SPACE.search(self.buf, self.pos)
            end = m.start() if m else len(self.buf)
            self.line += self.buf.count("\n", self.pos, end)
            self.pos = end
            if m:
                return m.group(0)
            if not self._fill():
                return ""

    def value(self) -> Optional[str]:
        """The text of the JSON value at `pos`, which moves past it; None when the file ends inside it.

        Found by its brackets and quotes alone (an integer for the depth, no recursion), so a value nested
        10,000 levels deep costs a scan, not a parse."""
        start, i, depth = self.pos, self.pos, 0
        if self.buf[start] not in '"[{':  # a number, true, false or null
            while True:
                m = _SCALAR_END.search(self.buf, i)
                if m or self.eof:
                    return self._take(m.start() if m else len(self.buf))
                i = len(self.buf) - self.pos
                self._fill()
                i += self.pos
        in_string = False
        while True:
            m = (_STRING_END if in_string else _STRUCTURE).search(self.buf, i)
            if m is None or m.end() > len(self.buf) - (m.group(0) == "\\"):
                # Not in this chunk (or an escape at its very end): read on, keeping the value's start.
                i = (m.start() if m else len(self.buf)) - self.pos
                if not self._fill():
                    return None
                i += self.pos
                continue
            ch, i = m.group(0), m.end()
            if in_string:
                if ch == "\\":
                    i += 1  # the escaped character
                    continue
                in_string = False
                if depth == 0:
                    return self._take(i)
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return self._take(i)

    def parsed(self) -> Optional[tuple[Any]]:
        """(the JSON value at `pos`,) parsed in place by the C decoder, `pos` moved past it; None (`pos` kept)
        when it does not parse within the buffer, or ends at its end (a number may go on in the next chunk)."""
        try:
            obj, end = _DECODER.raw_decode(self.buf, self.pos)
        except (json.JSONDecodeError, RecursionError):
            return None
        if end == len(self.buf) and not self.eof:
            return None
        self._take(end)
        return (obj,)

    def _take(self, end: int) -> str:
        text = self.buf[self.pos : end]
        self.line += text.count("\n")
        self.pos = end
        return text

    def rest(self) -> str:
        while self._fill():
            pass
        return self._take(len(self.buf))
