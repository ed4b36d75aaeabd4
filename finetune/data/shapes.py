"""The bundled image set: pictures of shapes drawn with PIL (seeded), each with a question whose answer is
one checkable word (the shape, its colour, or how many there are), for training and scoring vision-language
models offline.

Generated on first use into `$FINETUNE_CACHE/shapes/<fingerprint>/` (images/NNNN.png and shapes.jsonl, the
`image_conversations` record kind's format), so nothing binary ships and every machine draws the same
pixels. The data stage holds questions out by its seed, as for every data set: those are the held-out image
questions the evaluation scores with exact match.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from finetune.modeling import cache

# Bump when the drawing or the questions change: a new folder is generated.
VERSION = 1
SEED = 0
NUM_IMAGES = 480
SIDE = 64  # pixels; the tiny model's processor keeps this size

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
COUNTS = (1, 2, 3)
QUESTIONS = {
    "shape": "What shape is in the picture? Answer in one word.",
    "colour": "What colour are the shapes? Answer in one word.",
    "count": "How many shapes are in the picture? Answer with a number.",
}


def _draw(shape: str, colour: tuple[int, int, int], count: int, rng: random.Random):
    """One picture: `count` shapes of one kind and colour in distinct quarters of a white square."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), "white")
    draw = ImageDraw.Draw(image)
    half = SIDE // 2
    for quarter in rng.sample(range(4), count):
        x0, y0 = (quarter % 2) * half, (quarter // 2) * half
        size = rng.randint(half * 5 // 8, half - 4)
        x, y = x0 + rng.randint(2, half - size - 2), y0 + rng.randint(2, half - size - 2)
        box = (x, y, x + size, y + size)
        if shape == "circle":
            draw.ellipse(box, fill=colour)
        elif shape == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=colour)
    return image


def records(num_images: int = NUM_IMAGES, seed: int = SEED) -> list[tuple[dict, tuple[str, str, int]]]:
    """(the record with its image's relative path, (shape, colour, count)) for each picture, one question each."""
    rng = random.Random(seed)
    out = []
    for i in range(num_images):
        shape, colour, count = rng.choice(SHAPES), rng.choice(sorted(COLOURS)), rng.choice(COUNTS)
        asked = rng.choice(sorted(QUESTIONS))
        answer = {"shape": shape, "colour": colour, "count": str(count)}[asked]
        record = {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": f"images/{i:04d}.png"},
                        {"type": "text", "text": QUESTIONS[asked]},
                    ],
                },
                {"role": "assistant", "content": answer},
            ]
        }
        out.append((record, (shape, colour, count)))
    return out


def write(out: Path, num_images: int = NUM_IMAGES, seed: int = SEED) -> Path:
    """The pictures and shapes.jsonl into `out`; the JSONL file's path."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    draw_rng = random.Random(seed + 1)
    lines = []
    for record, (shape, colour, count) in records(num_images, seed):
        image = _draw(shape, COLOURS[colour], count, draw_rng)
        image.save(out / record["messages"][0]["content"][0]["image"], format="PNG", optimize=False)
        lines.append(json.dumps(record))
    path = out / "shapes.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def bundled_path() -> Path:
    """The bundled image set's JSONL file, generated once into the cache."""
    key = hashlib.sha256(f"v{VERSION};seed={SEED};n={NUM_IMAGES};side={SIDE}".encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        write(out)

    folder = cache.build_once(cache.root() / "shapes" / key, build)
    return folder / "shapes.jsonl"
