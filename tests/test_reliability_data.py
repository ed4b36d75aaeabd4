"""The data stage against a hostile or unlucky user: a damaged cache, deep JSON, inputs that are not files.

- A damaged cache entry (64 KiB zeroed, a file truncated or deleted, in train, eval or the stats; its
  manifest lost) is found when used and rebuilt with a warning; the run directory's rows are those of a
  clean run; run directories hold checked copies, never links into the cache; what a killed builder
  left is removed on the next run; RUN_DIR/data damaged is one line for mode=train, and mode=data
  repairs it.
- JSON nested 10,000 levels is one located bad record for every reader, skipped and counted under
  data.on_error=skip.
- A device, FIFO or socket, or a folder holding one, is refused at once in one line.
- Reading is streamed: memory follows what is kept, not the file; progress counts the bytes read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
from helpers import REPO, SEQ_LEN, child_env, run_cli

from finetune.core.config import Config, TrainConfig
from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data import cache, prepare, samples, sources, stage, synthetic
from finetune.data.control import ControlTokens

DEEP = 10_000  # levels of nesting in the deep records
ARROW = "data-00000-of-00001.arrow"


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic.build_tokenizer(
        synthetic.corpus_of(synthetic.conversations(60, seed=9, median_words=15)),
        synthetic.LLAMA3,
        vocab_size=400,
    )


def _convs(n: int, seed: int = 0) -> list:
    return synthetic.conversations(n, seed=seed, median_words=15, sigma=0.6)


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(path: Path, cache_dir: Path, **data) -> Config:
    return Config(
        data=DataConfig(path=str(path), cache_dir=str(cache_dir), **data), train=TrainConfig(seq_len=512)
    )


def _columns(run: Path) -> dict:
    """Every column of the prepared rows in RUN_DIR/data, as lists."""
    train, evals = stage.load_prepared(run)
    return {
        split: {c: ds.data.column(c).to_pylist() for c in ds.column_names}
        for split, ds in (("train", train), ("eval", evals))
    }


def _stats(result: dict) -> dict:
    """data_stats.json less what differs between two preparations of the same data (time, the cache's state)."""
    return {k: v for k, v in result.items() if k not in ("seconds", "cache")}


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a read that never ends, an open that blocks)."""

    def fail(signum, frame):
        raise AssertionError(f"still running after {seconds} s: it blocks or never ends")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- the cache, checked when used


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tokenizer):
    """300 conversations prepared once: (their file, the pristine cache, a clean run, its stats, its rows)."""
    root = tmp_path_factory.mktemp("clean")
    data = _write_jsonl(root / "chats.jsonl", [{"messages": c} for c in _convs(300)])
    result = stage.run(_cfg(data, root / "cache"), root / "run", tokenizer=tokenizer)
    return data, root / "cache", root / "run", result, _columns(root / "run")


def _fresh_cache(clean, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the pristine cache for one test to damage: (cache root, its entry)."""
    data, pristine, _, result, _ = clean
    shutil.copytree(pristine, tmp_path / "cache")
    return tmp_path / "cache", tmp_path / "cache" / result["cache"]["fingerprint"]


def test_run_dirs_hold_checked_copies_not_links(clean):
    data, pristine, run, result, _ = clean
    entry = pristine / result["cache"]["fingerprint"]
    listed = cache.read_manifest(run / "data")
    assert listed == cache.read_manifest(entry) and "train/" + ARROW in listed and "stats.json" in listed
    for name in listed:
        copy, original = os.stat(run / "data" / name), os.stat(entry / name)
        assert copy.st_nlink == 1 and copy.st_ino != original.st_ino, name
    cache.verify(run / "data")


def _damage(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "zero_64k":
        n = min(64 << 10, size // 2)
        with path.open("r+b") as f:
            f.seek(size // 4)
            before = f.read(n)
            f.seek(size // 4)
            f.write(b"\0" * n)
        assert before != b"\0" * n  # the bytes really changed
    elif how == "truncate":
        os.truncate(path, size // 2)
    else:
        path.unlink()


SPLIT_FILES = {"train": f"train/{ARROW}", "eval": f"eval/{ARROW}", "stats": "stats.json"}


@pytest.mark.parametrize("split", sorted(SPLIT_FILES))
@pytest.mark.parametrize("how", ["zero_64k", "truncate", "delete"])
def test_damaged_cache_entry_is_rebuilt_with_a_warning(clean, tmp_path, tokenizer, caplog, split, how):
    data, _, clean_run, clean_result, clean_rows = clean
    cache_root, entry = _fresh_cache(clean, tmp_path)
    _damage(entry / SPLIT_FILES[split], how)
    with caplog.at_level(logging.WARNING):
        result = stage.run(_cfg(data, cache_root), tmp_path / "run", tokenizer=tokenizer)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is damaged" in warnings[0] and SPLIT_FILES[split] in warnings[0], warnings
    assert result["cache"]["hit"] is False
    assert _columns(tmp_path / "run") == clean_rows  # the labels (and every other column) of a clean run
    assert _stats(result) == _stats(clean_result)
    cache.verify(entry)  # rebuilt in place
    assert stage.run(_cfg(data, cache_root), tmp_path / "again", tokenizer=tokenizer)["cache"]["hit"] is True
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")]  # nothing left behind
    cache.verify(clean_run / "data")  # the run that shared the entry before is untouched


@pytest.mark.parametrize("how", ["missing", "garbage", "stats_unlisted"])
def test_entry_without_a_readable_manifest_is_rebuilt(clean, tmp_path, tokenizer, caplog, how):
    """What a finetune before checksums left (no manifest.json), or a manifest damaged: prepared again."""
    data, _, _, _, clean_rows = clean
    cache_root, entry = _fresh_cache(clean, tmp_path)
    manifest = entry / cache.MANIFEST
    if how == "missing":
        manifest.unlink()
    elif how == "garbage":
        manifest.write_text('{"files": {"train/')
    else:
        files = json.loads(manifest.read_text())["files"]
        files.pop("stats.json")
        manifest.write_text(json.dumps({"files": files}))
    with caplog.at_level(logging.WARNING):
        result = stage.run(_cfg(data, cache_root), tmp_path / "run", tokenizer=tokenizer)
    assert result["cache"]["hit"] is False and any("is damaged" in r.getMessage() for r in caplog.records)
    assert _columns(tmp_path / "run") == clean_rows


def test_a_damaged_entry_that_cannot_be_removed_is_one_line(clean, tmp_path, tokenizer, monkeypatch):
    data, *_ = clean
    cache_root, entry = _fresh_cache(clean, tmp_path)
    _damage(entry / SPLIT_FILES["train"], "truncate")
    rename = os.rename

    def read_only(
        src, dst, *args, **kwargs
    ):  # as on a cache folder this user cannot write (root can write all)
        if Path(src) == entry:
            raise PermissionError(13, "Permission denied", str(src))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(cache.os, "rename", read_only)
    with pytest.raises(DataError) as exc:
        stage.run(_cfg(data, cache_root), tmp_path / "run", tokenizer=tokenizer)
    msg = str(exc.value)
    assert "\n" not in msg and str(entry) in msg and "truncated" in msg and "data.cache_dir" in msg
    assert not (tmp_path / "run" / "data").exists()  # nothing half-published


def test_killed_builders_leftovers_are_removed_on_the_next_run(clean, tmp_path, tokenizer):
    data, *_ = clean
    cache_root, _ = _fresh_cache(clean, tmp_path)
    killed = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from finetune.data import cache\n"
        "with cache.building(Path(sys.argv[1]), 'k' * 32) as tmp:\n"
        "    (tmp / 'train').mkdir()\n"
        "    (tmp / 'train' / 'half.arrow').write_bytes(b'x' * 4096)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", killed, str(cache_root)], env=child_env(), cwd=REPO)
    assert proc.returncode == -signal.SIGKILL
    (cache_root / f"{cache._TMP}old-1234abcd").mkdir()  # what a builder killed mid-write leaves
    (cache_root / f"{cache._STALE}{'d' * 32}-0000").mkdir()  # a damaged entry half removed
    left = sorted(p.name for p in cache_root.iterdir() if p.name.startswith("."))
    assert sum(n.startswith(".tmp-kkkk") for n in left) == 2  # the folder and its lock
    with cache.building(cache_root, "l" * 32) as live:  # a builder alive meanwhile keeps its folder
        (live / "part").write_text("in progress")
        result = stage.run(_cfg(data, cache_root), tmp_path / "run", tokenizer=tokenizer)
        assert (live / "part").read_text() == "in progress"
        assert sorted(p.name for p in cache_root.iterdir() if p.name.startswith(".")) == sorted(
            [live.name, live.name + cache._LOCK]
        )
    assert result["cache"]["hit"] is True
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")]


def _cli(args: list[str], capsys) -> tuple[int, str]:
    from finetune.pipeline.cli import main

    code = main(args)
    return code, capsys.readouterr().err


def test_mode_data_and_mode_train_agree_on_damage(tmp_path, tiny_tokenizer, capsys, caplog):
    """A damaged cache file, both ways: it never reaches the run directory (mode=train
    trains on the checked copy) and mode=data rebuilds it; RUN_DIR/data damaged is one line for
    mode=train, and mode=data copies it again."""
    data = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in _convs(120, seed=3)])
    common = [
        f"data.path={data}",
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        SEQ_LEN,
    ]
    code, err = _cli(["mode=data", *common], capsys)
    assert code == 0, err
    rows = _columns(tmp_path / "run")
    entry = Path(json.loads((tmp_path / "run" / "data_stats.json").read_text())["cache"]["dir"])

    _damage(entry / SPLIT_FILES["train"], "truncate")
    stage.check_prepared(tmp_path / "run")  # what mode=train checks: the copy is intact
    assert _columns(tmp_path / "run") == rows
    with caplog.at_level(logging.WARNING):
        code, err = _cli(["mode=data", *common], capsys)
    assert code == 0 and "cache miss" in err.replace("\n", " "), err
    assert [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]

    _damage(tmp_path / "run" / "data" / SPLIT_FILES["train"], "zero_64k")
    code, err = _cli(["mode=train", *common], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"train/{ARROW} does not match its checksum" in lines[0] and "mode=data" in lines[0]
    code, err = _cli(["mode=data", *common], capsys)
    assert code == 0 and "cache hit" in err.replace("\n", " "), err
    assert _columns(tmp_path / "run") == rows


def test_damaged_data_stats_is_one_line_for_the_plan(tmp_path, capsys, tiny_tokenizer):
    data = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in _convs(60, seed=4)])
    common = [f"data.path={data}", f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert _cli(["mode=data", "train.seq_len=auto", *common], capsys)[0] == 0
    (tmp_path / "run" / "data_stats.json").write_text('{"seq_len": 1')
    code, err = _cli(["mode=plan", "train.seq_len=auto", *common], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "data_stats.json: unreadable" in err, err


# ---------------------------------------------------------------- JSON nested 10,000 levels


def _deep_text() -> str:
    return "[" * DEEP + "]" * DEEP


def _deep_inputs(folder: Path) -> dict[str, tuple[Path, int]]:
    """One input per reader, each with 4 good conversations and one nested DEEP levels: (path, its line)."""
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    convs = _convs(4, seed=5)
    good = [json.dumps({"messages": c}) for c in convs]
    deep = '{"messages": ' + _deep_text() + "}"
    out = {}
    p = folder / "deep.jsonl"
    p.write_text("\n".join([good[0], good[1], deep, good[2], good[3]]) + "\n")
    out["jsonl"] = (p, 3)
    p = folder / "deep_array.json"
    p.write_text("[\n" + ",\n".join([good[0], good[1], deep, good[2], good[3]]) + "\n]\n")
    out["json_array"] = (p, 4)
    cells = [json.dumps(c) for c in convs[:2]] + [_deep_text()] + [json.dumps(c) for c in convs[2:]]
    p = folder / "deep.csv"
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        w.writerows([c] for c in cells)
    out["csv_cell"] = (p, 4)
    p = folder / "deep.parquet"
    pq.write_table(pa.table({"messages": cells}), p)
    out["parquet_cell"] = (p, 3)
    p = folder / "saved"
    Dataset.from_dict({"messages": cells}).save_to_disk(str(p))
    out["datasets_cell"] = (p, 3)
    return out


@pytest.fixture(scope="module")
def deep_inputs(tmp_path_factory):
    return _deep_inputs(tmp_path_factory.mktemp("deep"))


@pytest.mark.parametrize("reader", ["jsonl", "json_array", "csv_cell", "parquet_cell", "datasets_cell"])
def test_deep_nesting_is_one_located_bad_record(deep_inputs, tmp_path, tokenizer, reader):
    path, line = deep_inputs[reader]
    cfg = _cfg(path, tmp_path / "cache", near_dedup=False, eval_fraction=0.25)
    with pytest.raises(DataError) as exc:
        stage.run(cfg, tmp_path / "run", tokenizer=tokenizer)
    msg = str(exc.value)
    assert "\n" not in msg and f"line {line}: " in msg and "nested too deeply" in msg and "1 too_deep" in msg
    skipped = stage.run(
        _cfg(path, tmp_path / "cache", near_dedup=False, eval_fraction=0.25, on_error="skip"),
        tmp_path / "run",
        tokenizer=tokenizer,
    )
    assert skipped["dropped"] == {"too_deep": 1} and skipped["num_input"] == 5
    assert skipped["num_train"] + skipped["num_eval"] == 4


def test_deep_single_object_json_file_is_one_bad_record(tmp_path):
    p = tmp_path / "one.json"
    p.write_text('{"messages": ' + _deep_text() + "}")
    records, loaded = _read(p)
    assert records == [] and loaded.bad_counts == {"too_deep": 1} and loaded.num_input == 1


def test_deeply_nested_parquet_schema_is_one_line(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    value: list = []
    for _ in range(200):
        value = [value]
    pq.write_table(pa.table({"messages": pa.array([value])}), tmp_path / "schema.parquet")
    # pyarrow's own reason: "too deeply nested" (26), "Invalid flatbuffers message" (25, what mlflow pins)
    with pytest.raises(
        DataError,
        match=r"schema\.parquet: not a readable Parquet file .*(too deeply nested|Invalid flatbuffers message)",
    ):
        stage.run(
            _cfg(tmp_path / "schema.parquet", tmp_path / "cache", on_error="skip"),
            tmp_path / "r",
            tokenizer=tokenizer,
        )


def test_deep_nesting_through_the_command_line_is_one_line(deep_inputs, tmp_path, capsys, tiny_tokenizer):
    path, _ = deep_inputs["jsonl"]
    common = [
        f"data.path={path}",
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.seq_len=512",
    ]
    for extra in ([], ["data.on_error=skip"]):
        code, err = _cli(["mode=data", "data.near_dedup=false", *extra, *common], capsys)
        lines = [
            line for line in err.splitlines() if line.strip() and "data:" not in line and "│" not in line
        ]
        if extra:
            assert code == 0, err
            assert json.loads((tmp_path / "run" / "data_stats.json").read_text())["dropped"] == {
                "too_deep": 1
            }
        else:
            assert code == 2 and len(lines) == 1 and "Traceback" not in err and "line 3" in lines[0], err


# ---------------------------------------------------------------- inputs that are not files


def _special(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A data.path that is no regular file, and the words the refusal must use."""
    if kind == "char_device":
        return Path("/dev/zero"), "a character device"
    if kind == "link_to_device":
        (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
        return tmp_path / "zero.jsonl", "a character device"
    if kind == "block_device":
        dev = next((p for p in sorted(Path("/dev").iterdir()) if _is(p, stat.S_ISBLK)), None)
        if dev is None:
            pytest.skip("no block device under /dev here")
        return dev, "a block device"
    base = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))  # a socket's path has at most 107 bytes
    folder = base / "in"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", [{"messages": c} for c in _convs(5)])
    name = (folder if kind in ("folder_with_fifo", "folder_with_socket") else base) / (
        "pipe.jsonl" if "fifo" in kind else "sock.jsonl"
    )
    if "fifo" in kind:
        os.mkfifo(name)
        words = "a FIFO"
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(name))
        s.close()  # the socket file stays
        words = "a socket"
    if kind == "folder_with_link_to_fifo":
        (folder / "link.jsonl").symlink_to(name)
    return (folder if kind.startswith("folder") else name), words


def _is(path: Path, test) -> bool:
    try:
        return test(path.stat().st_mode)
    except OSError:
        return False


@pytest.mark.parametrize(
    "kind",
    [
        "char_device",
        "link_to_device",
        "block_device",
        "fifo",
        "socket",
        "folder_with_fifo",
        "folder_with_socket",
        "folder_with_link_to_fifo",
    ],
)
def test_inputs_that_are_not_files_are_refused_at_once(tmp_path, tokenizer, kind):
    path, words = _special(tmp_path, kind)
    t0 = time.monotonic()
    with _deadline(30), pytest.raises(DataError) as exc:
        stage.run(_cfg(path, tmp_path / "cache"), tmp_path / "run", tokenizer=tokenizer)
    assert time.monotonic() - t0 < 10
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"data.path={path}: ") and words in msg, msg
    assert not (tmp_path / "cache").exists()  # refused before any cache work


@pytest.mark.parametrize("kind", ["char_device", "fifo"])
def test_the_command_line_refuses_them_too(tmp_path, kind, tiny_tokenizer):
    path, words = _special(tmp_path, kind)
    proc = run_cli(
        "mode=data",
        f"data.path={path}",
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'c'}",
        env=child_env(),
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- streamed, bounded by what is kept


def _read(path: Path) -> tuple[list, sources.Loaded]:
    loaded = sources.Loaded()
    inp, _ = sources.open_input(str(path))
    return list(sources.records(inp, loaded)), loaded


def _peak_while_reading(path: Path) -> tuple[int, int]:
    """(records read, the peak of Python allocations while reading them one at a time, keeping none)."""
    loaded = sources.Loaded()
    inp, _ = sources.open_input(str(path))
    tracemalloc.start()
    try:
        n = sum(1 for _ in sources.records(inp, loaded))
        return n, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_reading_is_streamed(tmp_path, fmt):
    """100,000 records read one at a time hold under 8 MB of Python objects, about a chunk of the file
    (1 MiB) or a batch of Parquet rows: read whole, the records alone took over 100 MB."""
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 100_000
    rows = [{"prompt": f"count to {i}", "completion": f"{i} and then some more words"} for i in range(n)]
    path = tmp_path / f"many.{fmt}"
    if fmt == "jsonl":
        _write_jsonl(path, rows)
    elif fmt == "json":
        path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, ["prompt", "completion"])
            w.writeheader()
            w.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    read, peak = _peak_while_reading(path)
    assert read == n
    assert peak < 8e6, f"{peak / 1e6:.1f} MB held while reading {path.stat().st_size / 1e6:.1f} MB"


def _collect_peak(rows: list, tmp_path: Path, name: str, on_error: str = "raise") -> tuple[int, int, int]:
    """(kept, bad, peak bytes of Python allocations) of the streamed pass over `rows` as JSONL lines."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    dc = DataConfig(on_error=on_error)
    loaded, tally = sources.Loaded(), samples.Tally()
    inp, _ = sources.open_input(str(path))
    scratch = tmp_path / f"{name}-scratch"
    scratch.mkdir()
    samples.clean.signatures(["warm up: datasketch's import is no sample's cost"])
    tracemalloc.start()
    try:
        records = sources.records(inp, loaded)
        to_samples = partial(
            samples.conversation,
            dc=dc,
            control=ControlTokens(set()),
            char_limit=10**6,
            tally=tally,
            formats=loaded.formats,
        )
        kept = samples.collect(records, loaded, dc, tally, scratch, to_samples)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    kept.close()
    return len(kept), sum(loaded.bad_counts.values()), peak


def test_memory_follows_what_is_kept_not_the_input(tmp_path, monkeypatch):
    """40,000 records: all distinct, all one record repeated, all malformed. Only kept samples cost memory,
    a fixed size each (digests, bucket keys, an offset: their text and MinHash row are on disk) plus one
    batch; duplicates and bad lines cost none."""
    n = 20_000
    monkeypatch.setattr(samples, "_BATCH", 1024)  # the batch's share of 20,000 samples: about 20 bytes each
    distinct = [{"prompt": f"count to {i}", "completion": f"{i}"} for i in range(n)]
    kept, _, peak_distinct = _collect_peak(distinct, tmp_path, "distinct")
    assert kept == n
    kept, _, peak_dups = _collect_peak([distinct[0]] * n, tmp_path, "dups")
    assert kept == 1
    _, bad, peak_bad = _collect_peak(["{not json"] * n, tmp_path, "bad", on_error="skip")
    assert bad == n
    per_kept = peak_distinct / n
    assert 100 < per_kept < 300, f"{per_kept:.0f} bytes a kept sample"
    assert peak_dups < 0.05 * peak_distinct and peak_bad < 0.05 * peak_distinct, (peak_dups, peak_bad)


def test_progress_counts_every_byte_or_row(tmp_path, tokenizer, monkeypatch):
    """The rich progress bar of the read: its total is the input's size, and it ends complete."""
    data = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in _convs(200, seed=6)])
    bars = []
    make = prepare.progress

    def recording(console):
        bar = make(console)
        bars.append(bar)
        return bar

    monkeypatch.setattr(prepare, "progress", recording)
    stage.run(_cfg(data, tmp_path / "cache"), tmp_path / "run", tokenizer=tokenizer)
    (read,) = [t for t in bars[0].tasks if t.description == "read"]
    assert read.total == read.completed == data.stat().st_size
    loaded = sources.Loaded()
    inp, _ = sources.open_input(str(tmp_path / "run" / "data" / "eval"))  # a save_to_disk folder: rows
    counted: list[int] = []
    assert len(list(sources.records(inp, loaded, counted.append))) == inp.size == sum(counted) > 0


# ---------------------------------------------------------------- neighbours of the readers


def test_json_array_items_are_read_one_by_one(tmp_path):
    """A malformed item is one bad record and the next is still read; an array broken off ends with one;
    invalid UTF-8 anywhere makes the file one bad record, as when it was read whole."""
    good = '{"prompt": "a", "completion": "b"}'
    p = tmp_path / "a.json"
    p.write_text(f'[\n{good},\n{{"prompt": oops}},\n1,\n{good}\n]\n')
    records, loaded = _read(p)
    assert [r.line for r in records] == [2, 5]
    assert [(b.line, b.reason) for b in loaded.first_bad] == [(3, "malformed_json"), (4, "not_an_object")]
    p.write_text(f"[\n{good},\n{good[:20]}")
    records, loaded = _read(p)
    assert len(records) == 1 and [(b.line, b.reason) for b in loaded.first_bad] == [(3, "malformed_json")]
    head = f"[\n{good},\n".encode() + b'{"prompt": "'
    p.write_bytes(head + b'\xff", "completion": "c"}]')
    records, loaded = _read(p)
    assert records == [] and [(b.line, b.reason) for b in loaded.first_bad] == [(3, "invalid_utf8")]
    assert f"at byte {len(head)}" in loaded.first_bad[0].message
    p.write_text("[]")
    records, loaded = _read(p)
    assert records == [] and loaded.empty_files == [str(p)]


def test_csv_cell_over_the_field_limit_is_a_bad_record(tmp_path):
    p = tmp_path / "big.csv"
    p.write_text("prompt,completion\nshort,fine\n" + "x" * 200_000 + ",y\n")
    records, loaded = _read(p)
    assert [r.line for r in records] == [2] and loaded.bad_counts == {"malformed_csv": 1}
    assert "field larger than field limit" in loaded.first_bad[0].message


def test_rows_gathered_in_pieces_equal_rows_gathered_at_once(monkeypatch):
    """The packed rows are gathered a few million tokens at a time: pieces of 7 tokens give the same rows."""
    import numpy as np

    from finetune.data import pack

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=40)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids = rng.integers(0, 1000, size=int(lengths.sum()))
    groups = [list(map(int, g)) for g in np.array_split(rng.permutation(40), 13)]
    whole = {k: v.to_pylist() for k, v in pack.gather_rows({"ids": ids}, starts, lengths, groups).items()}
    monkeypatch.setattr(pack, "_GATHER_TOKENS", 7)
    pieces = pack.gather_rows({"ids": ids}, starts, lengths, groups)
    assert pieces["ids"].num_chunks > 1
    assert {k: v.to_pylist() for k, v in pieces.items()} == whole
    assert whole["ids"][0] == [int(x) for i in groups[0] for x in ids[starts[i] : starts[i] + lengths[i]]]
    assert whole["position_ids"][0] == [p for i in groups[0] for p in range(lengths[i])]
    assert whole["seq_lengths"][0] == [int(lengths[i]) for i in groups[0]]
