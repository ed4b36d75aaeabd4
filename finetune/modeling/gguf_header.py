"""A GGUF file's header read with every declared length checked first, and its model shape checked for sense.

A GGUF header is a list of keys, values and tensor records, each string and array prefixed by the length it
claims. A damaged or hostile file can claim 2^62 bytes: a reader that trusts the claim allocates (or walks)
that much before it notices. Here each claim is held against the bytes that really follow it and against a
bound no real file comes near (`LIMITS`), through a memory map of the file (nothing is read that is not
looked at), before anything of that length exists; the tensor records must also lie inside the file. Then
`check_shape` refuses an architecture no converter should start on (0 heads, 4 billion layers): each a
one-line `ConfigError`, before transformers converts anything.

Values kept: numbers, strings up to `KEEP_STRING` characters, and numeric arrays up to `KEEP_ARRAY` entries;
longer ones (the vocabulary, its merges and scores) are walked over and kept as their length.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any, BinaryIO

from finetune.core import userfiles
from finetune.core.errors import ConfigError

KEY = "model.gguf_file"
_VERSIONS = (2, 3)
# The fixed-size value types (GGUF's numbering): u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64.
_FIXED = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# Bounds no real file comes near (the largest vocabularies hold about 260,000 tokens; chat templates and an
# embedded tokenizer.json are a few MB); a claim beyond one is damage.
LIMITS = {
    "key": 1 << 16,  # bytes of a key's name
    "string": 256 << 20,  # bytes of one string value
    "array": 1 << 26,  # entries of one array
    "keys": 1 << 20,  # metadata entries
    "tensors": 1 << 20,  # tensor records
    "dims": 8,  # dimensions of a tensor (ggml has 4)
}
KEEP_STRING = 1 << 20
KEEP_ARRAY = 4096


class _Reader:
    """Walks a memory map of the file; each length a record claims is checked before it is used."""

    def __init__(self, blob: Any, size: int, spec: str):
        self.blob, self.size, self.spec, self.pos = blob, size, spec, 0

    def fixed(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        if self.pos + width > self.size:
            raise ConfigError(f"{KEY}={self.spec}: damaged: the header ends at byte {self.size:,} mid-record")
        (value,) = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += width
        return value

    def claim(self, declared: int, unit: int, what: str, limit: str) -> int:
        """`declared` items of at least `unit` bytes each, checked against the rest of the file and LIMITS."""
        remaining = (self.size - self.pos) // max(unit, 1)
        return userfiles.check_declared(declared, remaining, what, KEY, self.spec, limit=LIMITS[limit])

    def string(self, what: str, limit: str = "string") -> tuple[int, int]:
        """(start, length) of a string, its length checked; nothing is copied."""
        length = self.claim(self.fixed("<Q"), 1, f"the length of {what}", limit)
        start = self.pos
        self.pos += length
        return start, length

    def text(self, start: int, length: int) -> str:
        return bytes(self.blob[start : start + length]).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> Any:
        if kind in _FIXED:
            return self.fixed(_FIXED[kind])
        if kind == _STRING:
            start, length = self.string(f"a string ({key})")
            return self.text(start, length) if length <= KEEP_STRING else length
        if kind == _ARRAY:
            inner = self.fixed("<I")
            if inner not in _FIXED and inner != _STRING:
                raise ConfigError(f"{KEY}={self.spec}: damaged: {key} is an array of unknown type {inner}")
            width = struct.calcsize(_FIXED[inner]) if inner in _FIXED else 8
            count = self.claim(self.fixed("<Q"), width, f"the length of an array ({key})", "array")
            if inner in _FIXED:
                start = self.pos
                self.pos += count * width
                if count > KEEP_ARRAY:
                    return count
                return list(struct.unpack_from(f"<{count}{_FIXED[inner][1]}", self.blob, start))
            for _ in range(count):
                self.string(f"a string in {key}")
            return count
        raise ConfigError(f"{KEY}={self.spec}: damaged: {key} has a value of unknown type {kind}")


def read(f: BinaryIO, spec: str) -> dict[str, Any]:
    """The metadata of the open GGUF file `f` (a regular file), every declared length checked against the
    file's size and `LIMITS`, the tensor records inside the file. One `ConfigError` line where one is not."""
    size = os.fstat(f.fileno()).st_size
    if size < 24:
        raise ConfigError(f"{KEY}={spec}: damaged: {size} bytes, shorter than a GGUF header")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        r = _Reader(blob, size, spec)
        r.pos = 4
        version = r.fixed("<I")
        if version not in _VERSIONS:
            raise ConfigError(f"{KEY}={spec}: GGUF version {version}; versions 2 and 3 are read")
        tensors = r.claim(r.fixed("<Q"), 8 + 4 + 4 + 8, "the count of tensor records", "tensors")
        keys = r.claim(r.fixed("<Q"), 8 + 4 + 1, "the count of metadata keys", "keys")
        meta: dict[str, Any] = {}
        for _ in range(keys):
            start, length = r.string("a key", "key")
            name = r.text(start, length)
            meta[name] = r.value(r.fixed("<I"), name)
        extents = []
        for _ in range(tensors):
            start, length = r.string("a tensor name", "key")
            dims = r.claim(r.fixed("<I"), 8, "the dimensions of a tensor", "dims")
            shape = [r.fixed("<Q") for _ in range(dims)]
            ggml_type, offset = r.fixed("<I"), r.fixed("<Q")
            extents.append((r.text(start, length), shape, ggml_type, offset))
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ConfigError(f"{KEY}={spec}: damaged: general.alignment={alignment!r}")
        data_start = (r.pos + alignment - 1) // alignment * alignment
        sizes = _block_sizes() if extents else {}
        for name, shape, ggml_type, offset in extents:
            if ggml_type in sizes:  # an unknown type: transformers names it
                _check_extent(name, shape, sizes[ggml_type], offset, max(0, size - data_start), spec)
    if "general.architecture" not in meta:
        raise ConfigError(f"{KEY}={spec}: damaged: no general.architecture in its header")
    return meta


def _block_sizes() -> dict[int, tuple[int, int]]:
    """(elements, bytes) of a block of each ggml type, from the `gguf` package (which transformers reads
    GGUF files with); empty without it (the conversion then refuses in one line anyway)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError:
        return {}
    return {int(t): (int(e), int(b)) for t, (e, b) in GGML_QUANT_SIZES.items()}


def _check_extent(
    name: str, shape: list[int], size: tuple[int, int], offset: int, data: int, spec: str
) -> None:
    """Refuse a tensor record whose bytes would lie past the end of the file."""
    elements = 1
    for dim in shape:
        elements *= dim
    nbytes = elements // size[0] * size[1]
    if offset + nbytes > data:
        raise ConfigError(
            f"{KEY}={spec}: damaged: tensor {name[:80]!r} {shape} would end at byte {offset + nbytes:,} of a "
            f"{data:,}-byte data section (the file is truncated, or not what its header says)"
        )


# What an architecture may plausibly declare: (key under the architecture's prefix, lowest, highest).
# The largest published models have about 130 layers, widths of about 25,000 and a few hundred heads.
SHAPE = (
    ("block_count", 1, 1024),
    ("embedding_length", 1, 1 << 17),
    ("feed_forward_length", 1, 1 << 20),
    ("attention.head_count", 1, 4096),
    ("attention.head_count_kv", 1, 4096),
    ("context_length", 1, 1 << 24),
    ("vocab_size", 1, 1 << 22),
)
REQUIRED = ("block_count", "embedding_length", "attention.head_count")


def check_shape(meta: dict[str, Any], arch: str, spec: str) -> None:
    """Refuse, in one line, a model shape no real model has (0 heads, 4 billion layers, a width of 2^40)
    before transformers builds it."""
    for name, low, high in SHAPE:
        key = f"{arch}.{name}"
        if key not in meta:
            if name in REQUIRED:
                raise ConfigError(f"{KEY}={spec}: its header has no {key}; a model needs it")
            continue
        value = meta[key]
        # Per-layer lists (some families give each layer its own width or head count).
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ConfigError(
                    f"{KEY}={spec}: {key}={v!r} is not a plausible value (between {low:,} and {high:,}); "
                    "the file is damaged or not a model"
                )
    heads, kv = meta[f"{arch}.attention.head_count"], meta.get(f"{arch}.attention.head_count_kv")
    width = meta[f"{arch}.embedding_length"]
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ConfigError(
            f"{KEY}={spec}: {arch}.attention.head_count={heads} is not a multiple of head_count_kv={kv}"
        )
    if isinstance(heads, int) and f"{arch}.attention.key_length" not in meta and width % heads:
        raise ConfigError(
            f"{KEY}={spec}: {arch}.embedding_length={width} does not divide into head_count={heads} heads"
        )
