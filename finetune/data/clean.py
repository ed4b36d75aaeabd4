"""Cleaning: personal data scrubbed to placeholders, exact and near duplicates, eval leaks.

Duplicates are judged on normalized text (Unicode NFKC, case-folded,
whitespace collapsed) of the whole conversation, roles included; an eval leak
also on the prompt alone (the user turns: `prompt_key`). Near
duplicates use MinHash LSH (`datasketch`) on word 3-gram shingles; a candidate
the index returns is confirmed by its estimated Jaccard similarity, so the
threshold means what it says. What the data stage holds a sample is fixed-size:
a 16-byte digest in sorted runs (`SeenDigests`), 8 bytes a band of LSH bucket
keys, and its MinHash row on disk (`Signatures`).
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import xxhash

from finetune.data.formats import Messages

NUM_PERM = 128

# Order matters: API keys and e-mails before the number patterns, IPs before phones.
_API_KEY = re.compile(
    r"\b(?:sk-(?:proj-)?[A-Za-z0-9_-]{16,}|sk_(?:live|test)_[A-Za-z0-9]{16,}|AKIA[0-9A-Z]{16}|"
    r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|xox[abprs]-[A-Za-z0-9-]{10,}|"
    r"AIza[0-9A-Za-z_-]{35}|hf_[A-Za-z0-9]{30,}|"
    # generic: a 32+ character run mixing letters and digits (hex secrets, bearer tokens)
    r"(?=[A-Za-z0-9_-]*[0-9])(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9_-]{32,})\b"
)
# AWS secret access keys: 40 characters of base64 (with '/' and '+', which the pattern above stops at),
# mixing upper and lower case and digits, standing alone.
_AWS_SECRET = re.compile(
    r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+]*[0-9])(?=[A-Za-z0-9/+]*[a-z])(?=[A-Za-z0-9/+]*[A-Z])"
    r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
)
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(
    r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\w.])"
)
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}(?![\w:])")
_CARD = re.compile(r"(?<![\w-])(?:\d[ -]?){12,18}\d(?![\w-])")
# At least one separator or a leading +, so plain numbers (answers, years, counts) are left alone.
_PHONE = re.compile(
    r"(?<![\w+])(?<!\d[ .-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]?\d{3,4}(?![\w-])(?![ .]\d)"
    r"|(?<![\w+])\+\d{8,14}(?!\w)"
)


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def scrub_pii(text: str, counts: Counter) -> str:
    """Replace e-mails, phones, IPs, card numbers (Luhn-valid) and API-key-like tokens by <EMAIL>, <PHONE>, ..."""

    def sub(pattern: re.Pattern, tag: str, s: str, check=None) -> str:
        def repl(m: re.Match) -> str:
            if check is not None and not check(m.group(0)):
                return m.group(0)
            counts[tag] += 1
            return f"<{tag}>"

        return pattern.sub(repl, s)

    if not any(ch.isdigit() or ch == "@" for ch in text) and len(text) < 32:
        return text
    text = sub(_AWS_SECRET, "API_KEY", text)
    text = sub(_API_KEY, "API_KEY", text)
    text = sub(_EMAIL, "EMAIL", text)
    text = sub(_IPV4, "IP", text)
    text = sub(_IPV6, "IP", text)
    text = sub(_CARD, "CARD", text, check=lambda s: _luhn(re.sub(r"\D", "", s)))
    text = sub(_PHONE, "PHONE", text)
    return text


def normalize(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def conversation_key(msgs: Messages) -> str:
    return "\n".join(f"{m['role']}: {normalize(m['content'])}" for m in msgs)


def prompt_key(msgs: Messages) -> str:
    """What a conversation asks: its user turns' normalized text, without the system turn (a held-out prompt
    restated under another system prompt is the same prompt) or the answers; a conversation with no user turn
    is keyed by all of it (`conversation_key`), so such samples never collide on an empty prompt."""
    users = [f"user: {normalize(m['content'])}" for m in msgs if m["role"] == "user"]
    return "\n".join(users) if users else conversation_key(msgs)


def exact_digest(key: str) -> bytes:
    """The SHA-1 of a conversation's key: equal for exact duplicates (20 bytes a sample, kept while reading)."""
    return hashlib.sha1(key.encode()).digest()


def exact_digest16(key: str) -> bytes:
    """XXH3-128 of a conversation's key: 16 bytes, equal for exact duplicates (the streamed pass keeps it)."""
    return xxhash.xxh3_128_digest(key.encode())


class SeenDigests:
    """A set of 16-byte digests held as a few sorted numpy runs (16 bytes a digest, about twice that while
    two runs merge), where a Python set of bytes takes about 100: for exact duplicates among 10M samples.
    Runs merge like a binary counter, so there are O(log n) of them and each digest is re-sorted O(log n)
    times."""

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def add_new(self, digests: np.ndarray) -> np.ndarray:
        """For each of `digests` (an 'S16' array, in order): True where it was seen neither before nor
        earlier in this batch (the first occurrence wins); those are added."""
        new = np.zeros(len(digests), dtype=bool)
        new[np.unique(digests, return_index=True)[1]] = True
        for run in self._runs:
            pos = np.minimum(np.searchsorted(run, digests), len(run) - 1)
            new &= run[pos] != digests
        fresh = np.sort(digests[new])
        if len(fresh):
            self._runs.append(fresh)
        while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
            last = self._runs.pop()
            merged = np.concatenate([self._runs.pop(), last])
            del last
            merged.sort()
            self._runs.append(merged)
        return new


def _shingles(key: str) -> list[bytes]:
    words = re.findall(r"\w+", key)
    if len(words) < 3:
        return [w.encode() for w in words] or [b""]
    return list({" ".join(words[i : i + 3]).encode() for i in range(len(words) - 2)})


def signatures(keys: Sequence[str]) -> np.ndarray:
    """datasketch's MinHash of each key's shingles, one row of NUM_PERM uint32 values a key (its hash values
    are 32-bit): 512 bytes a sample instead of a MinHash object's 1.2 kB. A block of keys is hashed at once
    (`_minhash_rows`, datasketch's own permutations and hash): a call a key cost four times as much on
    tiny keys (1.31 against 0.31 CPU s for 20,000). The first key's values are checked against a MinHash's;
    where they differ (another datasketch), every key is computed by datasketch itself."""
    from datasketch import MinHash

    out = np.empty((len(keys), NUM_PERM), dtype=np.uint32)
    m = MinHash(num_perm=NUM_PERM)
    shingles = [_shingles(key) for key in keys]
    if shingles and _batchable(m, shingles[0]):
        for a in range(0, len(keys), _BLOCK):
            out[a : a + _BLOCK] = _minhash_rows(m.permutations, shingles[a : a + _BLOCK])
        return out
    for i, sh in enumerate(shingles):  # one MinHash cleared and refilled a key: datasketch's own values
        m.clear()
        m.update_batch(sh)
        out[i] = m.hashvalues
    return out


# Keys hashed together by `_minhash_rows`: 512 bytes a shingle while they are (64 tiny keys ran faster than
# 256 or 1,024: the block stays in the CPU's cache).
_BLOCK = 64


def _batchable(m: Any, first: list[bytes]) -> bool:
    """Whether `_minhash_rows` computes what this cleared MinHash does: its scheme and hash function are the
    ones it implements, and the values for `first` agree (`m` is left holding them)."""
    from datasketch import hashfunc

    if getattr(m, "scheme", None) != "affine32" or getattr(m, "hashfunc", None) is not hashfunc.sha1_hash32:
        return False
    m.update_batch(first)
    return bool(np.array_equal(m.hashvalues, _minhash_rows(m.permutations, [first])[0]))


def _minhash_rows(permutations: np.ndarray, shingles: list[list[bytes]]) -> np.ndarray:
    """What `MinHash.update_batch` leaves in a cleared MinHash for each list of shingles, computed for all
    of them together: datasketch's "affine32" scheme (sha1_hash32, the MurmurHash3 finalizer, a * h + b
    modulo 2^32, the minimum over shingles) in one array operation."""
    from datasketch.minhash import _fmix

    a, b = permutations
    flat = [s for sh in shingles for s in sh]
    hv = np.frombuffer(b"".join(hashlib.sha1(s).digest()[:4] for s in flat), dtype="<u4").astype(np.uint32)
    hv = _fmix(hv, 32).reshape(-1, 1)
    starts = np.cumsum([0] + [len(sh) for sh in shingles[:-1]])
    return np.minimum.reduceat(hv * a + b, starts, axis=0)


class Signatures:
    """MinHash rows and their LSH bucket keys for one threshold, added a block at a time.

    The keys (8 bytes a band and sample: 64 bytes with datasketch's 8 bands at 0.85) stay in memory; the
    rows (512 bytes a sample) stay there too, or, given a file, are appended to it as they come and read
    back a row at a time for the few candidate pairs only: held in memory they were half of what 10M tiny
    samples kept (5 GB; scripts/bench_data_memory.py). Rows are read with `pread`, not memory-mapped, so
    they never count in the process's resident memory.
    """

    def __init__(self, threshold: float, path: Optional[Path] = None) -> None:
        self.threshold = threshold
        self.bands = _bands(threshold)
        self._key_blocks: list[np.ndarray] = []
        self._keys: Optional[list[np.ndarray]] = None
        self._memory: list[np.ndarray] = []
        self._file = None if path is None else open(path, "w+b")  # noqa: SIM115 (closed by `close`)
        self.count = 0

    @classmethod
    def of(cls, sig: np.ndarray, threshold: float) -> Signatures:
        """An in-memory store of the rows of `sig` (uint32, NUM_PERM columns)."""
        out = cls(threshold)
        out.add(sig)
        return out

    def __len__(self) -> int:
        return self.count

    def add(self, block: np.ndarray) -> None:
        """Rows for the next samples: their bucket keys computed, the rows kept or written."""
        if not len(block):
            return
        self._key_blocks.append(np.stack([_band_keys(block[:, a:b], a, b) for a, b in self.bands]))
        self._keys = None
        if self._file is None:
            self._memory.append(block)
        else:
            self._file.write(np.ascontiguousarray(block, dtype=np.uint32).tobytes())
        self.count += len(block)

    def keys(self, band: int) -> np.ndarray:
        """The bucket key of every sample for band `band` (uint64)."""
        if self._keys is None:
            blocks = self._key_blocks
            whole = np.concatenate(blocks, axis=1) if blocks else np.zeros((len(self.bands), 0), np.uint64)
            self._key_blocks = [whole]
            self._keys = list(whole)
        return self._keys[band]

    def row(self, i: int) -> np.ndarray:
        """The MinHash row of sample `i`."""
        if self._file is None:
            if len(self._memory) > 1:
                self._memory = [np.concatenate(self._memory)]
            return self._memory[0][i]
        self._file.flush()
        size = NUM_PERM * 4
        return np.frombuffer(os.pread(self._file.fileno(), size, i * size), dtype=np.uint32)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The Jaccard similarity two signatures estimate (as `MinHash.jaccard` computes it)."""
    return float(np.count_nonzero(a == b)) / float(len(a))


def _bands(threshold: float) -> list[tuple[int, int]]:
    """datasketch's LSH bands for this threshold: the (start, end) columns of each of its b bands of r rows."""
    from datasketch import MinHashLSH

    return MinHashLSH(threshold=threshold, num_perm=NUM_PERM).hashranges


# Odd multipliers that fold a band of 32-bit values into one 64-bit bucket key (fixed: results never depend on them).
_FOLD = np.random.default_rng(0x5EED).integers(1, 2**63, size=NUM_PERM, dtype=np.uint64) | np.uint64(1)


def _band_keys(band: np.ndarray, start: int, end: int) -> np.ndarray:
    """One 64-bit key for each row of `band` (columns [start, end) of signature rows): rows with equal bands
    get equal keys (a rare equal key for unequal bands only adds a candidate, which is checked band for band)."""
    keys = (band.astype(np.uint64) * _FOLD[start:end]).sum(axis=1, dtype=np.uint64)
    return keys ^ (keys >> np.uint64(29))


def _shared(keys: np.ndarray) -> np.ndarray:
    """True for every row whose key another row has too."""
    ordered = np.sort(keys)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    return np.isin(keys, repeated)


def _similar(sig: Signatures, a: int, b: int, j: int, i: int) -> bool:
    """Rows j and i of `sig` share band [a, b) and their estimated Jaccard similarity reaches its threshold."""
    rj, ri = sig.row(j), sig.row(i)
    return bool(np.array_equal(rj[a:b], ri[a:b])) and jaccard(rj, ri) >= sig.threshold


# Ours beside datasketch's MinHashLSH, with its bands and the same answers: its in-memory index holds a
# bytes key and a set per band and sample (measured in scripts/bench_data_memory.py: BENCHMARKS.md),
# where these bucket keys take 8 bytes a band; only samples sharing a bucket are compared one by one.
def near_duplicates(sig: Signatures, rows: Optional[np.ndarray] = None) -> np.ndarray:
    """For each of `rows` of `sig` (default: all), in order: True when it is a near duplicate of an earlier
    kept one (the first occurrence wins): it shares a whole LSH band with it, and their estimated Jaccard
    similarity reaches the threshold."""
    rows = np.arange(len(sig)) if rows is None else np.asarray(rows)
    bands = sig.bands
    keys = [sig.keys(band)[rows] for band in range(len(bands))]
    candidates = np.zeros(len(rows), dtype=bool)
    for k in keys:
        candidates |= _shared(k)
    dup = np.zeros(len(rows), dtype=bool)
    kept: list[dict[int, list[int]]] = [{} for _ in bands]
    for i in np.flatnonzero(candidates).tolist():
        hit = any(
            _similar(sig, a, b, int(rows[j]), int(rows[i]))
            for (a, b), k, table in zip(bands, keys, kept)
            for j in table.get(int(k[i]), ())
        )
        dup[i] = hit
        if not hit:
            for k, table in zip(keys, kept):
                table.setdefault(int(k[i]), []).append(i)
    return dup


def leaks(
    train_exact: Sequence[bytes] | np.ndarray,
    eval_exact: Sequence[bytes] | np.ndarray,
    sig: Optional[Signatures],
    train_rows: np.ndarray,
    eval_rows: np.ndarray,
) -> np.ndarray:
    """For each train item: True when it is an exact (same digest) or near duplicate of some eval item
    (their signatures are rows `train_rows` and `eval_rows` of `sig`)."""
    train_exact, eval_exact = np.asarray(train_exact), np.asarray(eval_exact)
    out = np.isin(train_exact, eval_exact) if len(train_exact) else np.zeros(0, dtype=bool)
    if sig is None or not len(eval_rows):
        return out
    train_rows, eval_rows = np.asarray(train_rows), np.asarray(eval_rows)
    for band, (a, b) in enumerate(sig.bands):
        eval_keys = sig.keys(band)[eval_rows]
        train_keys = sig.keys(band)[train_rows]
        table: dict[int, list[int]] = {}
        for j, key in enumerate(eval_keys.tolist()):
            table.setdefault(key, []).append(int(eval_rows[j]))
        for i in np.flatnonzero(~out & np.isin(train_keys, eval_keys)).tolist():
            out[i] = any(_similar(sig, a, b, j, int(train_rows[i])) for j in table[int(train_keys[i])])
    return out
