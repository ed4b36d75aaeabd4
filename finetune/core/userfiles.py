"""Reading the files a user names in a setting (regression prompts, a GGUF header, a reward's own data):
regular files only, and never more than a stated bound.

A device (`/dev/zero` never ends), a FIFO (opening one blocks until a writer comes), a socket or a folder is
refused by `stat` before anything is opened, and again on the descriptor (opened non-blocking, so a FIFO
swapped in after the check cannot hang the run). The size is compared with the bound before a byte is read,
and the read itself stops at the bound (a file that grows meanwhile is not read past it). `check_declared`
holds a length a file declares about itself (a GGUF string or array) against the bytes that are really
there, before anything of that length is allocated.

Each refusal is one line naming the setting (`key`), the path and what to do: exit 2.

User code may call `read_text` / `read_bytes` too (a reward that loads its own answer key), with its own
`key` for the message.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Union

from finetune.core.errors import ConfigError, FinetuneError, format_bytes

# A text file of prompts, answers or settings: far more than any such file, far less than memory.
TEXT_LIMIT = 64 << 20

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)

PathLike = Union[str, "os.PathLike[str]"]


def kind_of(mode: int) -> str:
    """What a file of this `st_mode` is, in words ('a regular file', 'a FIFO (named pipe)', ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _refusal(key: str, path: Path, mode: int, error: type[FinetuneError]) -> FinetuneError:
    return error(
        f"{key}={path}: is {kind_of(mode)}, not a file; refusing to read it (it could block or never end): "
        "name a regular file"
    )


def check_regular(path: PathLike, key: str, error: type[FinetuneError] = ConfigError) -> int:
    """The size of `path` when it is a regular file (links followed); else one line naming `key`."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise error(f"{key}={p}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(key, p, st.st_mode, error)
    return st.st_size


def check_size(
    size: int, limit: int, key: str, path: PathLike, error: type[FinetuneError] = ConfigError
) -> None:
    if size > limit:
        raise error(
            f"{key}={path}: {format_bytes(size)}, more than the {format_bytes(limit)} such a file may hold; "
            "is it the right file?"
        )


@contextmanager
def open_regular(path: PathLike, key: str, error: type[FinetuneError] = ConfigError) -> Iterator[BinaryIO]:
    """`path` opened for binary reading, refused unless both the name and the descriptor are a regular file."""
    p = Path(path)
    check_regular(p, key, error)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{key}={p}: cannot open it ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refusal(key, p, mode, error)
    # Reads of a regular file never block; the flag only mattered for the open.
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        yield f


def read_bytes(
    path: PathLike, key: str, limit: int = TEXT_LIMIT, error: type[FinetuneError] = ConfigError
) -> bytes:
    """The whole file, refused when it is not a regular file or holds more than `limit` bytes."""
    with open_regular(path, key, error) as f:
        check_size(os.fstat(f.fileno()).st_size, limit, key, path, error)
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise error(f"{key}={path}: cannot read it ({exc.strerror})") from None
    check_size(len(data), limit, key, path, error)  # it grew while being read
    return data


def read_text(
    path: PathLike, key: str, limit: int = TEXT_LIMIT, error: type[FinetuneError] = ConfigError
) -> str:
    """The file as UTF-8 text (`read_bytes`), or one line saying where it is not UTF-8."""
    data = read_bytes(path, key, limit, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{key}={path}: not UTF-8 text (byte {exc.start})") from None


def check_declared(
    declared: int,
    available: int,
    what: str,
    key: str,
    path: PathLike,
    *,
    limit: int | None = None,
    error: type[FinetuneError] = ConfigError,
) -> int:
    """A length a file declares about its own contents (`what`: 'the length of a key'), held against the
    `available` bytes that follow it (and an absolute `limit`) before anything of that length is allocated or
    walked; returns it."""
    if declared < 0 or declared > available or (limit is not None and declared > limit):
        bound = (
            f"{available:,} bytes remain"
            if declared > available or limit is None
            else f"the limit is {limit:,}"
        )
        raise error(
            f"{key}={path}: damaged: it declares {what}: {declared:,} ({bound}); is it the right file?"
        )
    return declared
