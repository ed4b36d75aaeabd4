"""Cleaning: personal data scrubbed to placeholders, exact and near duplicates, eval leaks.

Duplicates are judged on normalized text (Unicode NFKC, case-folded,
whitespace collapsed) of the whole conversation, roles included. Near
duplicates use MinHash LSH (`datasketch`) on word 3-gram shingles; a candidate
the index returns is confirmed by its estimated Jaccard similarity, so the
threshold means what it says.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence

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


def exact_hash(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()


def _shingles(key: str) -> list[bytes]:
    words = re.findall(r"\w+", key)
    if len(words) < 3:
        return [w.encode() for w in words] or [b""]
    return list({" ".join(words[i : i + 3]).encode() for i in range(len(words) - 2)})


def minhashes(keys: Sequence[str]) -> list:
    from datasketch import MinHash

    return MinHash.bulk((_shingles(k) for k in keys), num_perm=NUM_PERM)


def _lsh(threshold: float):
    from datasketch import MinHashLSH

    return MinHashLSH(threshold=threshold, num_perm=NUM_PERM)


def near_duplicates(hashes: list, threshold: float) -> list[bool]:
    """True for every item that is a near duplicate of an earlier kept item (first occurrence wins)."""
    lsh = _lsh(threshold)
    dup = []
    for i, mh in enumerate(hashes):
        hit = any(hashes[j].jaccard(mh) >= threshold for j in lsh.query(mh))
        dup.append(hit)
        if not hit:
            lsh.insert(i, mh)
    return dup


def leaks(
    train_keys: Sequence[str],
    train_hashes: list | None,
    eval_keys: Sequence[str],
    eval_hashes: list | None,
    threshold: float,
) -> list[bool]:
    """True for every train item that is an exact or near duplicate of some eval item."""
    eval_exact = {exact_hash(k) for k in eval_keys}
    out = [exact_hash(k) in eval_exact for k in train_keys]
    if train_hashes is None or eval_hashes is None or not eval_hashes:
        return out
    lsh = _lsh(threshold)
    for j, mh in enumerate(eval_hashes):
        lsh.insert(j, mh)
    for i, mh in enumerate(train_hashes):
        if not out[i]:
            out[i] = any(eval_hashes[j].jaccard(mh) >= threshold for j in lsh.query(mh))
    return out
