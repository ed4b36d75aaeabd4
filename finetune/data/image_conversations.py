"""The `image_conversations` record kind (SFT on a model that takes images): messages whose user turns hold
image parts, one conversation a row, the images stored in the row.

A record is `{"messages": [...]}` as for text, where a message's `content` may be a list of parts:
`{"type": "text", "text": ...}` and `{"type": "image", "image": PATH}` (`path` is accepted too). PATH is a
local image file or a folder of them (each image in it, in name order), relative to the JSONL file's
folder; an `http(s)://` address is refused (nothing is downloaded). The model's processor renders each
conversation with its chat template and resizes its images by its own rules, here to measure each sample's
tokens (image tokens included) against `train.seq_len` (longer ones are dropped), and again as it trains
(`finetune.modeling.vision.VisionCollator`: labels on the assistant text only, image tokens never labelled).
No packing: the processor's image placeholders belong to one conversation.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core import userfiles
from finetune.core.config import Config
from finetune.core.errors import DataError
from finetune.data import limits, sources, stats
from finetune.data import rows as saved_rows
from finetune.modeling.vision import IMAGE_SUFFIXES, rendered

REMOTE = ("http://", "https://")

# An image file: far more than a photograph or a scan holds, far less than memory.
IMAGE_LIMIT = 64 << 20


@dataclass
class Sample:
    messages: list[dict]  # image parts as {"type": "image"} placeholders, in order
    images: list[bytes]  # each image file's bytes
    length: int = 0  # tokens, image tokens included
    image_tokens: int = 0
    trainable: int = 0


@dataclass
class Prepared:
    stats: dict
    train: list[Sample]
    eval: list[Sample]


def _image_files(value: Any, base: Path, where: str) -> list[Path]:
    """The image files an image part names: one file, or every image of a folder."""
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: an image part needs an `image` path (a local file or folder)")
    if value.lower().startswith(REMOTE):
        raise DataError(
            f"{where}: image {value} is a remote address; images are read from local files only "
            "(download it and give its path)"
        )
    path = (base / value).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"{where}: image folder {value} holds no image ({', '.join(IMAGE_SUFFIXES)})")
        return files
    if not path.is_file():
        raise DataError(f"{where}: image {value} is not a file (looked for {path})")
    return [path]


def _read_image(file: Path, where: str) -> bytes:
    """An image file's bytes, read through the bounded reader of user files (a regular file of at most
    `IMAGE_LIMIT` bytes, links followed) and decoded once here, so a damaged image or a decompression bomb (more
    pixels than PIL's `MAX_IMAGE_PIXELS`, which it finds from the header before decoding) is one line naming
    the record, not a traceback from the processor."""
    from PIL import Image

    try:
        data = userfiles.read_bytes(file, "image", IMAGE_LIMIT, DataError)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # the header: its size checked before any pixel
                image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: image {file} refused: {exc}") from None
    except Image.UnidentifiedImageError:
        raise DataError(
            f"{where}: image {file} is not an image PIL can read (damaged, or another kind of file)"
        ) from None
    except Exception as exc:  # a damaged image: PIL raises several types (OSError, SyntaxError, ValueError)
        raise DataError(
            f"{where}: image {file} cannot be decoded ({type(exc).__name__}: {exc}); is it damaged?"
        ) from None
    return data


def read_images(value: Any, base: Path, where: str) -> list[bytes]:
    """The bytes of each image an image part names (a file, or a folder's images in name order), bounded and
    checked as the data stage reads them."""
    return [_read_image(file, where) for file in _image_files(value, base, where)]


def _sample(record: sources.Record) -> Sample:
    """A record's messages with image placeholders and its images' bytes; malformed ones one line."""
    where = f"{record.source}:{record.line}"
    messages = record.data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: no `messages` list")
    base = Path(record.source).parent
    out, images = [], []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise DataError(f"{where}: each message needs a role of system, user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise DataError(f"{where}: a message's content is a string or a list of text and image parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                for file in _image_files(part.get("image", part.get("path", part.get("url"))), base, where):
                    images.append(_read_image(file, where))
                    parts.append({"type": "image"})
            else:
                raise DataError(
                    f"{where}: a content part is {{type: text, text}} or {{type: image, image: PATH}}"
                )
        if message["role"] == "assistant" and any(p["type"] == "image" for p in parts):
            raise DataError(f"{where}: an assistant turn holds an image; images go in user turns")
        out.append({"role": message["role"], "content": parts})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant turn to learn")
    return Sample(out, images)


def _measure(sample: Sample, processor: Any) -> None:
    """Tokens, image tokens and labelled tokens of a sample as the processor renders it."""
    out = rendered(processor, [sample.messages], [sample.images], with_labels=True)
    ids = out["input_ids"][0]
    sample.length = int(ids.numel())
    sample.image_tokens = int((ids == processor.image_token_id).sum())
    sample.trainable = int((out["labels"][0] != -100).sum())


def _held_out(sample: Sample, seed: int, fraction: float) -> bool:
    """By the digest of the seed and the sample's text and image bytes: stable under input order."""
    h = hashlib.sha1(f"{seed}:{json.dumps(sample.messages, sort_keys=True)}".encode())
    for image in sample.images:
        h.update(hashlib.sha1(image).digest())
    return int.from_bytes(h.digest()[:8], "big") / 2**64 < fraction


def prepare(
    cfg: Config, tokenizer: Any, inp: sources.Input, path: str, console, scratch: Optional[Path] = None
) -> Prepared:
    """Image conversations read, checked, measured by the model's processor (`tokenizer` here), split and
    limited to `train.seq_len` tokens (image tokens included)."""
    t0 = time.perf_counter()
    dc, loaded = cfg.data, sources.Loaded()
    hard = limits.hard_limit(cfg)
    kept: list[Sample] = []
    dropped = {"too_long": 0, "duplicate": 0}
    seen: set[str] = set()
    for record in sources.records(inp, loaded):
        sample = _sample(record)
        key = hashlib.sha1(json.dumps(sample.messages).encode() + b"".join(sample.images)).hexdigest()
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        _measure(sample, tokenizer)
        if sample.length > hard:
            dropped["too_long"] += 1
            continue
        kept.append(sample)
    if loaded.first_bad:
        raise DataError(f"data.path={path}: {next(sources.iter_where(loaded))}")
    if not kept:
        raise DataError(f"data.path={path}: no image conversation left to train on (dropped: {dropped})")
    held = [_held_out(s, dc.seed, dc.eval_fraction) for s in kept]
    train = [s for s, h in zip(kept, held) if not h]
    evals = [s for s, h in zip(kept, held) if h]
    if not train:
        train, evals = evals[:1], evals[1:]
    seq_len = hard if cfg.train.seq_len == "auto" else int(cfg.train.seq_len)
    train_lengths, eval_lengths = [s.length for s in train], [s.length for s in evals]
    overall = stats.summary(train_lengths + eval_lengths)
    result = {
        "num_input": loaded.num_input,
        "num_train": len(train),
        "num_eval": len(evals),
        "dropped": {k: v for k, v in dropped.items() if v},
        "tokens": {
            "train_total": sum(train_lengths),
            "eval_total": sum(eval_lengths),
            **{k: overall[k] for k in ("min", "p50", "p95", "p99", "max")},
        },
        "splits": {"train": stats.summary(train_lengths), "eval": stats.summary(eval_lengths)},
        "trainable_tokens": {
            "train": sum(s.trainable for s in train),
            "eval": sum(s.trainable for s in evals),
        },
        "images": {
            "train": sum(len(s.images) for s in train),
            "eval": sum(len(s.images) for s in evals),
            "image_tokens": sum(s.image_tokens for s in train + evals),
        },
        "masks": {"train_on": "assistant", "method": "generation_markers", "image_tokens_labelled": 0},
        "seq_len": seq_len,
        "seq_len_source": "train.seq_len" if cfg.train.seq_len != "auto" else "auto: the longest kept sample",
        "input": {"path": path, "fingerprint": None},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return Prepared(result, train, evals)


def _dataset(samples: list[Sample]) -> Any:
    from datasets import Dataset, Features, Image, List, Value

    features = Features({"messages": Value("string"), "images": List(Image()), "tokens": Value("int32")})
    return Dataset.from_dict(
        {
            "messages": [json.dumps(s.messages) for s in samples],
            "images": [[{"bytes": b, "path": None} for b in s.images] for s in samples],
            "tokens": [s.length for s in samples],
        },
        features=features,
    )


def save(prepared: Prepared, out: Path) -> None:
    """The train and eval rows (messages as JSON text, the images' bytes) into the cache entry being built."""
    with saved_rows.quiet_datasets():
        _dataset(prepared.train).save_to_disk(str(out / rundir.DATA_TRAIN_DIR))
        _dataset(prepared.eval).save_to_disk(str(out / rundir.DATA_EVAL_DIR))


__all__ = ["prepare", "save"]
