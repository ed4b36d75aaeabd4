"""Reading raw records, streamed: local JSONL/JSON/Parquet/CSV files, a folder of them, a `save_to_disk`
folder, a hub name.

Records come one at a time (JSONL a line, a JSON array an item, CSV a row, Parquet a batch of rows, a
`datasets` table a row), so reading holds what the stage keeps, not the file. Only a JSON file that is
one object (`{"data": [...]}`, or a single record) is parsed whole: which of the two it is shows only
at its end. Every record keeps where it came from (file and line, or row), so a bad one is reported as
`FILE line N: what is wrong`. Bad input is counted (`Loaded`), not raised at the first problem: the
stage then raises one `DataError` with the first location and the counts, or (data.on_error=skip)
skips and counts it. A record nested too deeply for Python's JSON reader (about 1,000 levels: it
raises RecursionError) is bad input too, counted as `too_deep`.

Only regular files are opened: a character or block device, a FIFO or a socket named by data.path, or
inside its folder, is refused by `stat` before anything is opened (`/dev/zero` never ends; opening a
FIFO blocks until a writer comes), and every open is non-blocking and checked again on the descriptor.
"""

from __future__ import annotations

import bisect
import codecs
import csv
import hashlib
import io
import json
import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data.jsontext import CHUNK, Advance, JsonText

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# Bad records located by place: the first in the error, these many in data_stats.json.
EXAMPLES = 5
_PARQUET_BATCH = 4096  # rows converted to Python at a time
TOO_DEEP = "nested too deeply for Python's JSON reader (RecursionError near 1,000 levels)"


@dataclass
class Record:
    source: str  # file name (or hub name)
    line: int  # 1-based line (JSONL, JSON, CSV) or row (Parquet, datasets)
    data: dict

    @property
    def where(self) -> str:
        return f"{self.source} line {self.line}"


@dataclass
class BadRecord:
    source: str
    line: int
    reason: str  # counted key: malformed_json, invalid_utf8, too_deep, missing_field, unknown_role, ...
    message: str

    @property
    def where(self) -> str:
        return f"{self.source} line {self.line}"


@dataclass
class Loaded:
    """What reading counted: every record read (good or bad), the bad ones by reason with the first
    `EXAMPLES` by place, and the files that held no record."""

    num_input: int = 0
    bad_counts: Counter = field(default_factory=Counter)
    first_bad: list[BadRecord] = field(default_factory=list)
    empty_files: list[str] = field(default_factory=list)
    # The format each good record was read as (data.format=auto detects it per record): data_stats.json.
    formats: Counter = field(default_factory=Counter)

    def add_bad(self, bad: BadRecord) -> None:
        """Count a bad record (read, or found when mapped to messages); keep it if among the first by place."""
        self.bad_counts[bad.reason] += 1
        bisect.insort(self.first_bad, bad, key=lambda b: (b.source, b.line))
        del self.first_bad[EXAMPLES:]


@dataclass
class Input:
    """What data.path names, not read yet: its files (each checked to be a regular file), or a `datasets.Dataset`."""

    name: str
    files: list[Path] = field(default_factory=list)
    dataset: Any = None

    @property
    def size(self) -> int:
        """How much there is to read, in the units `records` reports progress in: bytes, or a data set's rows."""
        if self.dataset is not None:
            return len(self.dataset)
        return sum(p.stat().st_size for p in self.files)


# ---------------------------------------------------------------------------------------------------------------
# Which files: regular ones only, checked before anything is opened

_SPECIAL = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_a_file(mode: int) -> str:
    return next((kind for test, kind in _SPECIAL if test(mode)), "not a regular file")


def _refuse(path: Path, inner: Path, mode: int) -> DataError:
    what = f"{inner} is {_not_a_file(mode)}" if inner != path else f"{_not_a_file(mode)}"
    return DataError(
        f"data.path={path}: {what}, not a data file; refusing to read it (it could block or never end); "
        "point data.path at regular files"
    )


def files_under(path: Path) -> list[Path]:
    """Every file an input consists of: itself, or each file under the folder (sorted, recursive; links to
    folders are not followed). Each is checked with `stat` before any is opened; a device, FIFO or socket
    is refused."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise DataError(f"data.path={path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISDIR(mode):
        if not stat.S_ISREG(mode):
            raise _refuse(path, path, mode)
        return [path]
    try:
        found = sorted(path.rglob("*"))
    except RecursionError:
        raise DataError(f"data.path={path}: folders nested too deeply to walk") from None
    except OSError as exc:
        raise DataError(f"data.path={path}: cannot list it ({exc.strerror})") from None
    files = []
    for p in found:
        try:
            mode = p.stat().st_mode
        except OSError:  # a dangling link: no file, as `is_file` says
            continue
        if stat.S_ISREG(mode):
            files.append(p)
        elif not stat.S_ISDIR(mode):
            raise _refuse(path, p, mode)
    return files


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading without blocking (a FIFO swapped in after the check opens at once), and
    refused unless the descriptor is a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(path, path, mode)
    return os.fdopen(fd, "rb")


def is_save_to_disk(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _SAVE_TO_DISK_MARKERS)


def input_files(path: Path) -> list[Path]:
    """The data files a path names: itself, or the supported files under a folder (sorted, recursive)."""
    files = files_under(path)
    if not path.is_dir():
        if path.suffix.lower() not in EXTENSIONS:
            raise DataError(f"data.path={path}: unsupported file type (use {', '.join(EXTENSIONS)})")
        return files
    files = [p for p in files if p.suffix.lower() in EXTENSIONS]
    if not files:
        raise DataError(f"data.path={path}: no {', '.join(EXTENSIONS)} files in this folder")
    return files


def content_fingerprint(path: Path) -> str:
    """sha256 over the names and bytes of every file the input consists of (the cache key's input part)."""
    h = hashlib.sha256()
    for p in files_under(path):
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode() + b"\0")
        with _open_regular(p) as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# The readers: each yields a file's records in order, good or bad

Item = Union[Record, BadRecord]


def _malformed(name: str, line: int, exc: json.JSONDecodeError) -> BadRecord:
    return BadRecord(name, line, "malformed_json", f"malformed JSON ({exc.msg}, column {exc.colno})")


def _read_jsonl(path: Path, name: str, advance: Advance) -> Iterator[Item]:
    with _open_regular(path) as f:
        unreported = 0
        for lineno, raw in enumerate(f, start=1):
            unreported += len(raw)
            if unreported >= CHUNK:
                advance(unreported)
                unreported = 0
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield BadRecord(name, lineno, "invalid_utf8", f"invalid UTF-8 at byte {exc.start}")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                yield _malformed(name, lineno, exc)
                continue
            except RecursionError:
                yield BadRecord(name, lineno, "too_deep", TOO_DEEP)
                continue
            if not isinstance(obj, dict):
                yield BadRecord(
                    name, lineno, "not_an_object", f"expected a JSON object, got {type(obj).__name__}"
                )
                continue
            yield Record(name, lineno, obj)
        advance(unreported)


def _invalid_utf8(f: BinaryIO, name: str) -> Optional[BadRecord]:
    """The whole file checked as UTF-8 in chunks (a JSON or CSV file with a bad byte is one bad record, as
    it was when read whole), the file left at its start; None when it decodes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0
    try:
        while True:
            chunk = f.read(CHUNK)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                # `exc.object` is the chunk after the bytes of a character the chunk before left unfinished.
                at = offset + exc.start - (len(exc.object) - len(chunk))
                line = lines + chunk.count(b"\n", 0, max(0, at - offset)) + 1
                return BadRecord(name, line, "invalid_utf8", f"invalid UTF-8 at byte {at}")
            if not chunk:
                return None
            offset += len(chunk)
            lines += chunk.count(b"\n")
    finally:
        f.seek(0)


def _item(name: str, line: int, index: int, text: str) -> Item:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return _malformed(name, line + exc.lineno - 1, exc)
    except RecursionError:
        return BadRecord(name, line, "too_deep", TOO_DEEP)
    return _record(name, line, index, obj)


def _record(name: str, line: int, index: int, obj: Any) -> Item:
    if not isinstance(obj, dict):
        return BadRecord(name, line, "not_an_object", f"item {index} is not a JSON object")
    return Record(name, line, obj)


def _read_json(path: Path, name: str, advance: Advance) -> Iterator[Item]:
    with _open_regular(path) as f:
        bad = _invalid_utf8(f, name)
        if bad is not None:
            yield bad
            return
        text = JsonText(f, advance)
        first = text.peek()
        if not first:
            return
        if first == "[":
            text.pos += 1
            yield from _array_items(text, name)
        else:
            yield from _whole(text.rest(), name)


def _array_items(text: JsonText, name: str) -> Iterator[Item]:
    """The items of a top-level JSON array, one at a time; a malformed item is one bad record (the next
    one is still read), an array that breaks off ends the file with one."""
    index = 0
    while True:
        ch = text.peek()
        if index and ch == ",":
            text.pos += 1
            ch = text.peek()
        elif ch == "]":
            text.pos += 1
            if text.peek():
                yield BadRecord(
                    name, text.line, "malformed_json", "malformed JSON (extra data after the array)"
                )
            return
        elif index:
            yield BadRecord(name, text.line, "malformed_json", "malformed JSON (expected ',' between items)")
            return
        if not ch or ch in ",]":
            yield BadRecord(name, text.line, "malformed_json", "malformed JSON (an item is missing)")
            return
        line = text.line
        parsed = text.parsed()
        if parsed is not None:
            yield _record(name, line, index, parsed[0])
        else:  # not parsed where it stands (malformed, too deep, or longer than the buffer): its extent, alone
            value = text.value()
            if value is None:
                yield BadRecord(
                    name, line, "malformed_json", "malformed JSON (the file ends inside this item)"
                )
                return
            yield _item(name, line, index, value)
        index += 1


def _whole(text: str, name: str) -> Iterator[Item]:
    """A JSON file that is one value: {"data": [records]} (one key holding a list of objects), one record, or bad."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        yield _malformed(name, exc.lineno, exc)
        return
    except RecursionError:
        yield BadRecord(name, 1, "too_deep", TOO_DEEP)
        return
    if isinstance(obj, dict):
        lists = [v for v in obj.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
        obj = lists[0] if len(lists) == 1 and len(obj) == 1 else [obj]
    if not isinstance(obj, list):
        yield BadRecord(name, 1, "not_an_object", "expected a JSON list of objects")
        return
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            yield BadRecord(name, 1, "not_an_object", f"item {i} is not a JSON object")
        else:
            yield Record(name, 1, item)


def _csv_lines(f: BinaryIO, advance: Advance) -> Iterator[str]:
    """The text lines of a (UTF-8 checked) CSV file, split as `newline=""` splits them (at \\n, \\r\\n and \\r)."""
    for i, raw in enumerate(f):
        advance(len(raw))
        text = raw.decode("utf-8-sig" if i == 0 else "utf-8")
        if "\r" in text:
            yield from io.StringIO(text, newline="")
        else:
            yield text


def _read_csv(path: Path, name: str, advance: Advance) -> Iterator[Item]:
    with _open_regular(path) as f:
        bad = _invalid_utf8(f, name)
        if bad is not None:
            yield bad
            return
        reader = csv.DictReader(_csv_lines(f, advance))
        start = 2
        try:
            for row in reader:
                if None in row:  # more cells than header names
                    yield BadRecord(name, start, "malformed_csv", "more cells than columns in the header")
                else:
                    yield Record(name, start, {k: v for k, v in row.items()})
                start = reader.line_num + 1
        except csv.Error as exc:  # a cell over the csv module's field size limit, a NUL byte
            yield BadRecord(name, start, "malformed_csv", f"malformed CSV ({exc})")


def _read_parquet(path: Path, name: str, advance: Advance) -> Iterator[Item]:
    import pyarrow.parquet as pq

    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        row = 0
        try:
            pf = pq.ParquetFile(f)
            total = max(pf.metadata.num_rows, 1)
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH):
                rows = batch.to_pylist()
                advance(size * batch.num_rows // total)
                for data in rows:
                    row += 1
                    yield Record(name, row, data)
        except Exception as exc:  # pyarrow raises several types for a broken file
            raise DataError(f"{name}: not a readable Parquet file (after row {row}: {exc})") from None


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def _rows(ds: Any, source: str, advance: Advance) -> Iterator[Item]:
    """A `datasets.Dataset` (from `load_from_disk` or the hub) as records, row numbers 1-based."""
    for i, row in enumerate(ds, start=1):
        if i % 1000 == 0:
            advance(1000)
        yield Record(source, i, dict(row))
    advance(len(ds) % 1000)


def records(inp: Input, loaded: Loaded, advance: Advance = lambda n: None) -> Iterator[Record]:
    """Every good record of the input, in order, one at a time; bad ones, every record read and the files
    without records are counted in `loaded`."""
    if inp.dataset is not None:
        readers = [(inp.name, _rows(inp.dataset, inp.name, advance))]
    else:
        readers = [(str(p), _READERS[p.suffix.lower()](p, str(p), advance)) for p in inp.files]
    for name, items in readers:
        n = 0
        for item in items:
            n += 1
            loaded.num_input += 1
            if isinstance(item, BadRecord):
                loaded.add_bad(item)
            else:
                yield item
        if n == 0:
            loaded.empty_files.append(name)


# ---------------------------------------------------------------------------------------------------------------
# Opening data.path


def _split(ds: Any, source: str, split: str) -> Any:
    """The split data.split names of a set of splits (a save_to_disk folder of a DatasetDict)."""
    from datasets import DatasetDict

    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"data.path={source}: no split data.split={split} (splits: {', '.join(ds)})")
        return ds[split]
    return ds


def is_local(path_or_name: str) -> bool:
    path = Path(path_or_name).expanduser()
    return path.exists() or path.is_symlink()


def open_input(
    path_or_name: str, fingerprint: Optional[str] = None, data: Optional[DataConfig] = None
) -> tuple[Input, str]:
    """What data.path names, ready to read, with a fingerprint of its content (`content_fingerprint` for a
    local path, unless given). A hub data set is read at data.split, data.subset and data.revision."""
    data = data or DataConfig()
    path = Path(path_or_name).expanduser()
    if is_local(path_or_name):
        # Every file is checked to be a regular one before the first is opened.
        fingerprint = fingerprint or content_fingerprint(path)
        if is_save_to_disk(path):
            from datasets import load_from_disk

            ds = _split(load_from_disk(str(path)), str(path), data.split)
            return Input(str(path), dataset=ds), fingerprint
        return Input(str(path), files=input_files(path)), fingerprint
    if path_or_name.startswith((".", "/", "~")) or path.suffix.lower() in EXTENSIONS:
        raise DataError(f"data.path={path_or_name}: no such file or folder")
    ds = _hub_dataset(path_or_name, data)
    where = f"hub:{path_or_name}:{data.subset}:{data.split}:{data.revision}"
    fingerprint = hashlib.sha256(f"{where}:{getattr(ds, '_fingerprint', '')}".encode()).hexdigest()
    return Input(path_or_name, dataset=ds), fingerprint


def _hub_dataset(name: str, data: DataConfig) -> Any:
    """`load_dataset(name, data.subset, split=data.split, revision=data.revision)`; a split, subset or
    revision it does not have, and the hub out of reach, in one line naming the key."""
    from datasets import load_dataset

    try:
        return load_dataset(name, data.subset, split=data.split, revision=data.revision)
    except (
        Exception
    ) as exc:  # offline, unknown name, gated, a split or subset it lacks: all the user's to fix
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        key = "data.path"
        if "split" in first.lower():
            key = "data.split"
        elif "config" in first.lower():
            key = "data.subset"
        elif "revision" in first.lower():
            key = "data.revision"
        raise DataError(
            f"{key}: the hub data set data.path={name} (data.subset={data.subset}, data.split={data.split}, "
            f"data.revision={data.revision}) cannot be loaded ({first})"
        ) from None


def iter_where(loaded: Loaded) -> Iterator[str]:
    for b in loaded.first_bad:
        yield f"{b.where}: {b.message}"
