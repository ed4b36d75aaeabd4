"""Reading raw records: local JSONL/JSON/Parquet/CSV files, a folder of them, a `save_to_disk` folder, a hub name.

Every record keeps where it came from (file and line, or row), so a bad one is
reported as `FILE line N: what is wrong`. Bad input is collected, not raised at
the first problem: the stage then raises one `DataError` with the first
location and the counts, or (data.on_error=skip) skips and counts it.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.core.errors import DataError

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


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
    reason: str  # counted key: malformed_json, invalid_utf8, missing_field, unknown_role, ...
    message: str

    @property
    def where(self) -> str:
        return f"{self.source} line {self.line}"


@dataclass
class Loaded:
    records: list[Record] = field(default_factory=list)
    bad: list[BadRecord] = field(default_factory=list)
    empty_files: list[str] = field(default_factory=list)

    @property
    def num_input(self) -> int:
        return len(self.records) + len(self.bad)


def is_save_to_disk(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _SAVE_TO_DISK_MARKERS)


def input_files(path: Path) -> list[Path]:
    """The data files a path names: itself, or the supported files under a folder (sorted, recursive)."""
    if path.is_file():
        if path.suffix.lower() not in EXTENSIONS:
            raise DataError(f"data.path={path}: unsupported file type (use {', '.join(EXTENSIONS)})")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
    if not files:
        raise DataError(f"data.path={path}: no {', '.join(EXTENSIONS)} files in this folder")
    return files


def content_fingerprint(path: Path) -> str:
    """sha256 over the names and bytes of every file the input consists of (the cache key's input part)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode() + b"\0")
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _read_jsonl(path: Path, name: str, out: Loaded) -> int:
    n = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            n += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                out.bad.append(BadRecord(name, lineno, "invalid_utf8", f"invalid UTF-8 at byte {exc.start}"))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                out.bad.append(
                    BadRecord(
                        name, lineno, "malformed_json", f"malformed JSON ({exc.msg}, column {exc.colno})"
                    )
                )
                continue
            if not isinstance(obj, dict):
                out.bad.append(
                    BadRecord(
                        name, lineno, "not_an_object", f"expected a JSON object, got {type(obj).__name__}"
                    )
                )
                continue
            out.records.append(Record(name, lineno, obj))
    return n


def _decode(path: Path, name: str, out: Loaded) -> str | None:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        out.bad.append(
            BadRecord(name, _line_of(data, exc.start), "invalid_utf8", f"invalid UTF-8 at byte {exc.start}")
        )
        return None


def _read_json(path: Path, name: str, out: Loaded) -> int:
    text = _decode(path, name, out)
    if text is None:
        return 1
    if not text.strip():
        return 0
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        out.bad.append(
            BadRecord(name, exc.lineno, "malformed_json", f"malformed JSON ({exc.msg}, column {exc.colno})")
        )
        return 1
    if isinstance(obj, dict):  # {"data": [...]} or a single record
        lists = [v for v in obj.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
        obj = lists[0] if len(lists) == 1 and len(obj) == 1 else [obj]
    if not isinstance(obj, list):
        out.bad.append(BadRecord(name, 1, "not_an_object", "expected a JSON list of objects"))
        return 1
    # Line numbers of the top-level items: find each item's opening brace by a light scan.
    starts = _top_level_item_lines(text)
    for i, item in enumerate(obj):
        line = starts[i] if i < len(starts) else 1
        if not isinstance(item, dict):
            out.bad.append(BadRecord(name, line, "not_an_object", f"item {i} is not a JSON object"))
            continue
        out.records.append(Record(name, line, item))
    return len(obj)


def _top_level_item_lines(text: str) -> list[int]:
    """Line numbers where the items of a top-level JSON array start (strings and nesting respected)."""
    lines, depth, line, in_str, esc = [], 0, 1, False, False
    for ch in text:
        if ch == "\n":
            line += 1
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{":
            if depth == 1 and ch == "{":
                lines.append(line)
            depth += 1
        elif ch in "]}":
            depth -= 1
    return lines


def _read_csv(path: Path, name: str, out: Loaded) -> int:
    text = _decode(path, name, out)
    if text is None:
        return 1
    reader = csv.DictReader(io.StringIO(text, newline=""))
    n = 0
    start = 2
    for row in reader:
        n += 1
        if None in row:  # more cells than header names
            out.bad.append(BadRecord(name, start, "malformed_csv", "more cells than columns in the header"))
        else:
            out.records.append(Record(name, start, {k: v for k, v in row.items()}))
        start = reader.line_num + 1
    return n


def _read_parquet(path: Path, name: str, out: Loaded) -> int:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a broken file
        raise DataError(f"{name}: not a readable Parquet file ({exc})") from None
    for i, row in enumerate(rows, start=1):
        out.records.append(Record(name, i, row))
    return len(rows)


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def load_files(path: Path) -> Loaded:
    out = Loaded()
    files = input_files(path)
    for p in files:
        name = str(p)
        n = _READERS[p.suffix.lower()](p, name, out)
        if n == 0:
            out.empty_files.append(name)
    return out


def load_datasets(ds: Any, source: str) -> Loaded:
    """A `datasets.Dataset` (from `load_from_disk` or the hub) as records, row numbers 1-based."""
    out = Loaded()
    for i, row in enumerate(ds, start=1):
        out.records.append(Record(source, i, dict(row)))
    if len(out.records) == 0:
        out.empty_files.append(source)
    return out


def _train_split(ds: Any, source: str) -> Any:
    from datasets import DatasetDict

    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise DataError(f"data.path={source}: no 'train' split (splits: {', '.join(ds)})")
        return ds["train"]
    return ds


def load(path_or_name: str) -> tuple[Loaded, str]:
    """Read every record of the input; returns them with a fingerprint of the input's content."""
    path = Path(path_or_name).expanduser()
    if path.exists():
        if is_save_to_disk(path):
            from datasets import load_from_disk

            ds = _train_split(load_from_disk(str(path)), str(path))
            return load_datasets(ds, str(path)), content_fingerprint(path)
        return load_files(path), content_fingerprint(path)
    if path_or_name.startswith((".", "/", "~")) or path.suffix.lower() in EXTENSIONS:
        raise DataError(f"data.path={path_or_name}: no such file or folder")
    try:
        from datasets import load_dataset

        ds = _train_split(load_dataset(path_or_name), path_or_name)
    except DataError:
        raise
    except Exception as exc:  # offline, unknown name, gated: all the user's to fix
        raise DataError(
            f"data.path={path_or_name}: not a local path, and the hub data set cannot be loaded ({exc})"
        ) from None
    fingerprint = hashlib.sha256(f"hub:{path_or_name}:{getattr(ds, '_fingerprint', '')}".encode()).hexdigest()
    return load_datasets(ds, path_or_name), fingerprint


def bad_summary(bad: list[BadRecord]) -> Counter:
    return Counter(b.reason for b in bad)


def iter_where(bad: list[BadRecord], limit: int = 5) -> Iterator[str]:
    for b in bad[:limit]:
        yield f"{b.where}: {b.message}"
