"""Replay data for SmolLM2-135M-Instruct: general prompts answered right and short, by the base where it can.

    python scripts/make_replay_data.py          # writes finetune/data/smollm2/replay.jsonl (minutes on 2 cores)
    python scripts/make_replay_data.py --answers finetune/data/smollm2/replay.jsonl   # re-check saved answers

Fine-tuning the model on the bundled task alone (one-word answers: odd, even, positive, negative) teaches
it to answer everything in one of those words: after 30 LoRA steps it kept 1 of the 29 regression checks
it passed before (BENCHMARKS.md). Mixing in conversations the base answered itself (self-distillation, a
replay of what it already did) keeps its general behaviour while the task is learned, but it also teaches
the replay's style: the base's raw answers to arithmetic are often long and wrong ("17 + 6 = 8", "To find
7 times 17, we can use the formula..."), and a model trained on them ran out of its 32 new tokens before
the number (23 of 29 checks kept, BENCHMARKS.md). So every answer is checked before it is replayed
(`_reference`): where the prompt's template has a known result (capitals, sums, products, translations,
lists, a few facts) the base's first sentence is kept if it states that result in at most a dozen words,
else the answer is written from the known result in the base's own words ("13 + 16 = 29.", 'In Spanish,
"sun" is "sol".'); free answers (a sentence, an explanation, a tip) keep the base's first one or two
sentences if they are on the topic, and are dropped otherwise. Prompts nearer the regression set's kinds (time
units, sums asked with "+", doubling and small products, words into English, a sentence about an animal) are
always answered from their known result (`NEAR`): a model trained on the replay's one-sentence form loses the
checks whose base answer is right only after a wrong first sentence (BENCHMARKS.md), so those
kinds need right first sentences to learn from. The prompts are built from templates; those
that are prompts of the regression set (finetune/data/regression/prompts.jsonl) are left out, so the
regression checks stay held out. Deterministic for a given model file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "finetune" / "data" / "smollm2" / "replay.jsonl"
MAX_NEW_TOKENS = 64

CAPITALS = {
    "Canada": "Ottawa", "Australia": "Canberra", "Egypt": "Cairo", "Brazil": "Brasilia", "India": "New Delhi",
    "China": "Beijing", "Russia": "Moscow", "Kenya": "Nairobi", "Mexico": "Mexico City",
    "Argentina": "Buenos Aires", "Portugal": "Lisbon", "Greece": "Athens", "Sweden": "Stockholm",
    "Norway": "Oslo", "Poland": "Warsaw", "Turkey": "Ankara", "Peru": "Lima", "Ireland": "Dublin",
    "Austria": "Vienna", "Belgium": "Brussels",
}  # fmt: skip
COUNTRIES = tuple(CAPITALS)
EXAMPLES = {
    "animals": ("Dog", "Cat", "Horse"), "vegetables": ("Carrot", "Onion", "Tomato"),
    "sports": ("Football", "Tennis", "Swimming"), "musical instruments": ("Piano", "Guitar", "Violin"),
    "planets": ("Earth", "Mars", "Jupiter"), "birds": ("Eagle", "Sparrow", "Owl"),
    "flowers": ("Rose", "Tulip", "Daisy"), "rivers": ("The Nile", "The Amazon", "The Danube"),
    "board games": ("Chess", "Monopoly", "Scrabble"), "kitchen tools": ("Knife", "Whisk", "Spatula"),
    "trees": ("Oak", "Pine", "Maple"), "programming languages": ("Python", "Java", "C"),
}  # fmt: skip
THINGS = tuple(EXAMPLES)
TOPICS = (
    "cats", "the moon", "rain", "coffee", "trains", "music", "winter", "the ocean", "books", "mountains",
    "bicycles", "friendship", "gardens", "bread", "the wind", "libraries",
)  # fmt: skip
CONCEPTS = (
    "photosynthesis", "gravity", "a computer", "an atom", "a volcano", "electricity", "a rainbow",
    "democracy", "a vaccine", "the internet", "a star", "evaporation",
)  # fmt: skip
LANGUAGES = ("French", "Spanish", "German", "Italian")
TRANSLATIONS = {  # word -> its translation into each of LANGUAGES
    "cat": ("chat", "gato", "Katze", "gatto"), "house": ("maison", "casa", "Haus", "casa"),
    "book": ("livre", "libro", "Buch", "libro"), "sun": ("soleil", "sol", "Sonne", "sole"),
    "moon": ("lune", "luna", "Mond", "luna"), "bread": ("pain", "pan", "Brot", "pane"),
    "friend": ("ami", "amigo", "Freund", "amico"), "school": ("école", "escuela", "Schule", "scuola"),
    "tree": ("arbre", "árbol", "Baum", "albero"), "milk": ("lait", "leche", "Milch", "latte"),
}  # fmt: skip
WORDS = tuple(TRANSLATIONS)
FACTS = {  # question -> (a pattern a right answer matches, the answer written from the known result)
    "How many minutes are in an hour?": (r"\b60\b", "There are 60 minutes in an hour."),
    "How many seconds are in a minute?": (r"\b60\b", "There are 60 seconds in a minute."),
    "How many months are in a year?": (r"\b12\b", "There are 12 months in a year."),
    "How many days are in a year?": (r"\b365\b", "There are 365 days in a year."),
    "How many legs does a spider have?": (r"\b8\b|\beight\b", "A spider has eight legs."),
    "What colour is grass?": (r"(?i)\bgreen\b", "Grass is green."),
    "Which planet is closest to the Sun?": (r"(?i)\bmercury\b", "Mercury is the planet closest to the Sun."),
    "What is the largest planet in the solar system?": (r"(?i)\bjupiter\b", "Jupiter is the largest planet."),
}  # fmt: skip
ACTIVITIES = ("studying", "running", "cooking rice", "saving money", "learning to draw", "writing an email")

# Prompts nearer the regression set's kinds (BENCHMARKS.md), answered right in one sentence from known
# results. Trained on the replay's one-sentence form, the model loses checks whose base answer reaches the result
# only after a wrong first sentence ("A day is approximately 86 minutes.", "7 + 7 = 12.", 'In Spanish, "dog" is
# "caballo".'). The regression's own facts stay out in every wording: no day of 24 hours, no week of 7 days, no
# 2 + 3, 7 + 7, 3 x 4, 2 x 5 or half of 10, and none of hello, dog and thank you translated.
UNIT_FACTS = {
    "How many hours are in a week?": "There are 168 hours in a week.",
    "How many hours are in two days?": "There are 48 hours in two days.",
    "How many hours are in three days?": "There are 72 hours in three days.",
    "How many hours are in half a day?": "There are 12 hours in half a day.",
    "How many minutes are in a day?": "There are 1,440 minutes in a day.",
    "How many minutes are in two hours?": "There are 120 minutes in two hours.",
    "How many minutes are in half an hour?": "There are 30 minutes in half an hour.",
    "How many seconds are in an hour?": "There are 3,600 seconds in an hour.",
    "How many days are in two weeks?": "There are 14 days in two weeks.",
    "How many days are in a leap year?": "There are 366 days in a leap year.",
    "How many days are in June?": "There are 30 days in June.",
    "How many weeks are in a year?": "There are 52 weeks in a year.",
    "How many centimetres are in a metre?": "There are 100 centimetres in a metre.",
    "How many grams are in a kilogram?": "There are 1,000 grams in a kilogram.",
    "How many sides does a triangle have?": "A triangle has three sides.",
    "How many wheels does a bicycle have?": "A bicycle has two wheels.",
    "What is the normal body temperature of a person in Celsius?": "It is about 37 degrees Celsius.",
}  # fmt: skip
MORE_WORDS = {  # more words for the translations both ways (LANGUAGES' order)
    "goodbye": ("au revoir", "adiós", "auf Wiedersehen", "arrivederci"),
    "water": ("eau", "agua", "Wasser", "acqua"), "please": ("s'il vous plaît", "por favor", "bitte", "per favore"),
    "yes": ("oui", "sí", "ja", "sì"),
}  # fmt: skip
SENTENCES = {  # one sentence about an animal, the animal named first (the base's "A loyal and loving companion...")
    "horses": "Horses are strong, fast animals that people have ridden for thousands of years.",
    "rabbits": "Rabbits are small animals with long ears that love to eat plants.",
    "birds": "Birds are animals with feathers, and most of them can fly.",
    "elephants": "Elephants are the largest land animals and have long trunks.",
    "bees": "Bees are insects that make honey and carry pollen from flower to flower.",
    "lions": "Lions are big cats that live in groups called prides.",
    "owls": "Owls are birds that hunt at night and can turn their heads very far.",
    "fish": "Fish live in water and breathe through their gills.",
}  # fmt: skip
HELD_OUT_SUMS = {(2, 3), (7, 7)}
HELD_OUT_PRODUCTS = {(3, 4), (2, 5)}


def near_regression() -> dict[str, str]:
    """Prompt -> its answer, written from the known result: the replay nearer the regression set's kinds."""
    out = dict(UNIT_FACTS)
    sums = [(4, 5), (6, 2), (8, 3), (9, 4), (5, 7), (6, 9), (12, 5), (3, 8), (11, 7)]
    sums += [(n, n) for n in (3, 4, 6, 8, 9, 11, 12, 15)]
    out |= {
        f"What is {a} + {b}?": f"{a} + {b} = {a + b}."
        for a, b in sums
        if (min(a, b), max(a, b)) not in HELD_OUT_SUMS
    }
    products = [(2, n) for n in (2, 3, 4, 6, 7, 8, 9, 11, 12)] + [(n, 2) for n in (3, 6, 8)]
    products += [(3, 3), (3, 5), (4, 4), (4, 5), (5, 6), (6, 6), (3, 6), (4, 6)]
    out |= {
        f"What is {a} times {b}?": f"{a} times {b} is {a * b}."
        for a, b in products
        if (min(a, b), max(a, b)) not in HELD_OUT_PRODUCTS
    }
    out |= {f"What is double {n}?": f"Double {n} is {2 * n}." for n in (3, 4, 6, 8, 9, 12)}
    out |= {f"What is half of {n}?": f"Half of {n} is {n // 2}." for n in (4, 6, 8, 12, 14, 20)}
    words = TRANSLATIONS | MORE_WORDS
    for english, foreign in words.items():
        for word in foreign:
            out.setdefault(
                f"What does '{word}' mean in English?",
                f'"{word[0].upper() + word[1:]}" means "{english}" in English.',
            )
    for english, foreign in MORE_WORDS.items():
        for lang, word in zip(LANGUAGES, foreign):
            out[f"Translate '{english}' into {lang}."] = f'In {lang}, "{english}" is "{word}".'
    for english in ("cat", "water", "book", "goodbye", "friend", "please"):
        for lang in ("French", "Spanish"):
            word = words[english][LANGUAGES.index(lang)]
            out[f"How do you say {english} in {lang}?"] = f'In {lang}, "{english}" is "{word}".'
    out |= {f"Write one sentence about {animal}.": s for animal, s in SENTENCES.items()}
    return out


NEAR = near_regression()


def prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = [f"What is the capital of {c}?" for c in COUNTRIES]
    pairs = [(a, b) for a, b in itertools.product(range(1, 20), repeat=2) if a <= b]
    rng.shuffle(pairs)
    out += [f"What is {a} plus {b}?" for a, b in pairs[:25]]
    out += [f"What is {a} times {b}?" for a, b in pairs[25:45]]
    out += [f"List three {t}." for t in THINGS]
    out += [f"Name three {t}, one per line." for t in THINGS[:6]]
    out += [f"Write one sentence about {t}." for t in TOPICS]
    out += [f"Explain what {c} is in two sentences." for c in CONCEPTS]
    out += [f"Translate '{w}' into {lang}." for w, lang in itertools.product(WORDS, LANGUAGES)]
    out += [f"Give me one tip for {a}." for a in ACTIVITIES]
    out += list(FACTS)
    out += [p for p in NEAR if p not in out]
    return out


def _full_sentences(text: str) -> str:
    """The answer up to its last sentence end or line break (the whole answer if it has none)."""
    text = text.strip()
    cut = max((m.end() for m in re.finditer(r"[.!?](\s|$)|\n", text)), default=0)
    return text[:cut].strip() if cut else text


def _sentences(text: str, n: int) -> str:
    """The first `n` sentences of `text` (on its first paragraph)."""
    first = text.strip().split("\n\n")[0].strip()
    ends = [m.end() for m in re.finditer(r"[.!?](\s|$)", first)]
    return first[: ends[n - 1]].strip() if len(ends) >= n else (first[: ends[-1]].strip() if ends else "")


def _reference(prompt: str) -> Optional[tuple[Optional[str], str]]:
    """(a pattern a right answer matches, the answer written from the known result), or None (a free answer).

    A pattern of None: the answer is always the written one.
    """
    if prompt in NEAR:
        return None, NEAR[prompt]
    if m := re.fullmatch(r"What is the capital of (.+)\?", prompt):
        city = CAPITALS[m[1]]
        return rf"(?i)\b{city}\b", f"The capital of {m[1]} is {city}."
    if m := re.fullmatch(r"What is (\d+) (plus|times) (\d+)\?", prompt):
        a, b = int(m[1]), int(m[3])
        result, sign = (a + b, "+") if m[2] == "plus" else (a * b, "times")
        # the first number stated after "=" / "is" must be the result (the base's "15 + 15 = 25." is not)
        return (
            rf"(=|\bis)\s*{result}\b(?!\s*[-+*x/])",
            f"{a} {sign} {b} {'=' if sign == '+' else 'is'} {result}.",
        )
    if m := re.fullmatch(r"Translate '(\w+)' into (\w+)\.", prompt):
        word = TRANSLATIONS[m[1]][LANGUAGES.index(m[2])]
        return rf"(?i)\b{word}\b", f'In {m[2]}, "{m[1]}" is "{word}".'
    if m := re.fullmatch(r"(List|Name) three (.+?)(, one per line)?\.", prompt):
        items = "\n".join(f"{i}. {x}" for i, x in enumerate(EXAMPLES[m[2]], 1))
        return (
            None,
            items,
        )  # the base's lists run long, repeat or invent items ("1. Violin 2. Violin 3. Violin")
    if prompt in FACTS:
        return FACTS[prompt]
    return None


def checked(prompt: str, answer: str) -> tuple[Optional[str], bool]:
    """(the answer to replay for `prompt` given the base's `answer`, right and short, or None: dropped; whether
    it is the base's own)."""
    ref = _reference(prompt)
    if ref is not None:
        pattern, written = ref
        first = _sentences(answer, 1) or answer.strip().split("\n")[0].strip()
        ok = pattern is not None and len(first.split()) <= 12 and re.search(pattern, first)
        return (first, True) if ok else (written, False)
    if m := re.fullmatch(r"Write one sentence about (.+)\.", prompt):
        topic, n = m[1].removeprefix("the "), 1
    elif m := re.fullmatch(r"Explain what (.+) is in two sentences\.", prompt):
        topic, n = m[1].split()[-1], 2
    else:  # a tip
        topic, n = "", 1
    reply = _sentences(answer, n)
    on_topic = re.search(rf"(?i)\b{re.escape(topic[:5].rstrip('s'))}", reply) if topic else reply
    return (reply, True) if on_topic and len(reply.split()) <= 60 else (None, False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--answers",
        type=Path,
        help="re-check the base answers of an earlier output instead of generating them",
    )
    args = parser.parse_args(argv)

    import torch

    from finetune.core.composition import compose
    from finetune.core.config.evaluation import EvalConfig
    from finetune.evaluation import regression
    from finetune.evaluation.generate import generate
    from finetune.modeling import loading, models, resolve

    held_out = {m["content"] for r in regression.load() for m in r["messages"] if m["role"] == "user"}
    asked = [p for p in prompts() if p not in held_out]  # the regression checks stay held out
    # an answer always written from its known result (a pattern of None) needs no base answer
    saved = {p: "" for p in asked if (ref := _reference(p)) is not None and ref[0] is None}
    if args.answers:  # greedy answers are deterministic: those saved stand for a new generation
        for line in args.answers.read_text("utf-8").splitlines():
            messages = json.loads(line)["messages"]
            saved[messages[0]["content"]] = messages[1]["content"]
    if to_ask := [p for p in asked if p not in saved]:
        torch.set_num_threads(1)  # shared cores: one thread is faster (finetune/train/stage.py: cpu_threads)
        model_cfg = resolve.resolve_model(compose(["model=smollm2_135m", "mode=plan"]).model)
        tokenizer = models.load_tokenizer(model_cfg)
        model = loading.load_pretrained(model_cfg, models.model_source(model_cfg), dtype=torch.float32)
        settings = EvalConfig(
            max_new_tokens=MAX_NEW_TOKENS, batch_size=args.batch_size, greedy=True, progress=True
        )
        answers = generate(
            model, tokenizer, [[{"role": "user", "content": p}] for p in to_ask], settings, "replay"
        )
        saved.update((p, _full_sentences(a)) for p, a in zip(to_ask, answers))
    _write(args.out, [(p, saved[p]) for p in asked])
    return 0


def _write(out: Path, answered: list[tuple[str, str]]) -> None:
    rows, kept = [], 0
    for prompt, answer in answered:
        reply, own = checked(prompt, answer)
        if reply:
            kept += own
            rows.append(
                {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} of {len(answered)} conversations to {out} ({kept} answered by the base itself)")


if __name__ == "__main__":
    raise SystemExit(main())
