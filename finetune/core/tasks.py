"""The bundled task: short, exactly checkable questions, and the metric that scores them.

Two kinds of question, chosen by trying several (see the README next to the
data) so that a tiny random-init model learns them with LoRA in minutes on a
CPU, and so that every held-out prompt is new:

- parity:    "Even or odd: 4817"                               -> "odd"
- sentiment: "Sentiment: Honestly, the trip felt pleasant."    -> "positive"

Parity asks about numbers never seen in training; the number ends the prompt,
so the deciding digit sits a fixed distance before the answer (mid-sentence
numbers, comparing two numbers, copying a digit, antonyms and word categories
stayed near chance within minutes). Sentiment sentences are new combinations
of a subject, a frame and one of 40 sentiment words.

`scripts/make_bundled_data.py` writes `generate(3000, 0)`; evaluation scores
greedy generations with `exact_match` (any data set) and breaks the score down
by `task_of` (the bundled one).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

SYSTEM_PROMPTS = (
    "You are a careful assistant. Answer with a single word.",
    "Reply with the answer only.",
)
# Share of conversations that open with a system turn.
SYSTEM_FRACTION = 0.25

PARITY_TEMPLATES = ("Even or odd: {n}", "Is this number even or odd? {n}", "Parity of {n}")

SENTIMENT_TEMPLATES = ("Is this positive or negative? {x}", "Sentiment: {x}", "Positive or negative? {x}")
POSITIVE_WORDS = [
    "good",
    "great",
    "love",
    "happy",
    "wonderful",
    "excellent",
    "nice",
    "amazing",
    "fantastic",
    "pleasant",
    "beautiful",
    "delightful",
    "superb",
    "brilliant",
    "perfect",
    "lovely",
    "fun",
    "awesome",
    "glad",
    "charming",
]
NEGATIVE_WORDS = [
    "bad",
    "terrible",
    "hate",
    "sad",
    "awful",
    "horrible",
    "poor",
    "boring",
    "ugly",
    "nasty",
    "dreadful",
    "annoying",
    "worst",
    "broken",
    "angry",
    "disappointing",
    "painful",
    "dull",
    "gross",
    "miserable",
]
SUBJECTS = [
    "movie",
    "food",
    "hotel",
    "book",
    "game",
    "show",
    "meal",
    "trip",
    "concert",
    "phone",
    "class",
    "party",
]
FRAMES = (
    "The {s} was {w}.",
    "I found the {s} {w}.",
    "What a {w} {s}!",
    "Honestly, the {s} felt {w}.",
    "My {s} today was {w}.",
    "Everyone said the {s} was {w}.",
)

TASK_NAMES = ("parity", "sentiment")

_TASK_PATTERNS = (
    ("parity", re.compile(r"\b(even or odd|parity of)\b", re.I)),
    ("sentiment", re.compile(r"\b(positive or negative|sentiment)\b", re.I)),
)


def parity_question(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 99999)
    return rng.choice(PARITY_TEMPLATES).format(n=n), "even" if n % 2 == 0 else "odd"


def sentiment_question(rng: random.Random) -> tuple[str, str]:
    positive = rng.random() < 0.5
    word = rng.choice(POSITIVE_WORDS if positive else NEGATIVE_WORDS)
    sentence = rng.choice(FRAMES).format(s=rng.choice(SUBJECTS), w=word)
    sentence = sentence[0].upper() + sentence[1:]
    return rng.choice(SENTIMENT_TEMPLATES).format(x=sentence), "positive" if positive else "negative"


def generate(rows: int, seed: int) -> list[dict]:
    """`rows` conversations with distinct user prompts, alternating the tasks, deterministic for a seed."""
    rng = random.Random(seed)
    makers = (parity_question, sentiment_question)
    seen: set[str] = set()
    out: list[dict] = []
    while len(out) < rows:
        question, answer = makers[len(out) % len(makers)](rng)
        if question in seen:
            continue
        seen.add(question)
        messages = []
        if rng.random() < SYSTEM_FRACTION:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    rng.shuffle(out)
    return out


def normalize_answer(text: str) -> str:
    """Case, surrounding whitespace and trailing punctuation do not count."""
    return text.strip().rstrip(".!").strip().lower()


def exact_match(prediction: str, reference: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(reference)


def task_of(prompt: str) -> str:
    """Which bundled task a user prompt asks ("other" for prompts from other data sets)."""
    for name, pattern in _TASK_PATTERNS:
        if pattern.search(prompt):
            return name
    return "other"


def score(prompts: Sequence[str], predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """`exact_match` over all rows, and per bundled task when the prompts are the bundled ones."""
    if not (len(prompts) == len(predictions) == len(references)):
        raise ValueError("prompts, predictions and references differ in length")
    hits = [exact_match(p, r) for p, r in zip(predictions, references)]
    result = {"exact_match": sum(hits) / len(hits) if hits else 0.0}
    by_task: dict[str, list[bool]] = {}
    for prompt, hit in zip(prompts, hits):
        by_task.setdefault(task_of(prompt), []).append(hit)
    if set(by_task) - {"other"}:
        for name, task_hits in sorted(by_task.items()):
            result[f"exact_match_{name}"] = sum(task_hits) / len(task_hits)
        if "other" in by_task:  # bundled tasks mixed with other prompts (replay data): the tasks alone
            ours = [hit for name, task_hits in by_task.items() if name != "other" for hit in task_hits]
            result["exact_match_tasks"] = sum(ours) / len(ours)
    return result
