"""Replay data for SmolLM2-135M-Instruct: general prompts answered by the base model itself.

    python scripts/make_replay_data.py          # writes finetune/data/smollm2/replay.jsonl (minutes on 2 cores)

Fine-tuning the model on the bundled task alone (one-word answers: odd, even, positive, negative) teaches
it to answer everything in one of those words: after 30 LoRA steps it kept 1 of the 29 regression checks
it passed before (BENCHMARKS.md). Mixing in conversations the base answered itself (self-distillation, a
replay of what it already did) keeps its general behaviour while the task is learned. The prompts are
built from templates over facts, arithmetic, lists, translation and short explanations; those that are prompts
of the regression set (finetune/data/regression/prompts.jsonl) are left out, so the regression checks
stay held out. Answers are greedy, at most MAX_NEW_TOKENS tokens, cut back to their last full sentence or
line so that no reply ends mid-word before its end-of-turn token. Deterministic for a given model file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "finetune" / "data" / "smollm2" / "replay.jsonl"
MAX_NEW_TOKENS = 64

COUNTRIES = (
    "Canada", "Australia", "Egypt", "Brazil", "India", "China", "Russia", "Kenya", "Mexico", "Argentina",
    "Portugal", "Greece", "Sweden", "Norway", "Poland", "Turkey", "Peru", "Ireland", "Austria", "Belgium",
)  # fmt: skip
THINGS = (
    "animals", "vegetables", "sports", "musical instruments", "planets", "birds", "flowers", "rivers",
    "board games", "kitchen tools", "trees", "programming languages",
)  # fmt: skip
TOPICS = (
    "cats", "the moon", "rain", "coffee", "trains", "music", "winter", "the ocean", "books", "mountains",
    "bicycles", "friendship", "gardens", "bread", "the wind", "libraries",
)  # fmt: skip
CONCEPTS = (
    "photosynthesis", "gravity", "a computer", "an atom", "a volcano", "electricity", "a rainbow",
    "democracy", "a vaccine", "the internet", "a star", "evaporation",
)  # fmt: skip
WORDS = ("cat", "house", "book", "sun", "moon", "bread", "friend", "school", "tree", "milk")
LANGUAGES = ("French", "Spanish", "German", "Italian")
ACTIVITIES = ("studying", "running", "cooking rice", "saving money", "learning to draw", "writing an email")


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
    return out


def _full_sentences(text: str) -> str:
    """The answer up to its last sentence end or line break (the whole answer if it has none)."""
    text = text.strip()
    cut = max((m.end() for m in re.finditer(r"[.!?](\s|$)|\n", text)), default=0)
    return text[:cut].strip() if cut else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)

    import torch

    from finetune.core.composition import compose
    from finetune.core.config.evaluation import EvalConfig
    from finetune.evaluation import regression
    from finetune.evaluation.generate import generate
    from finetune.modeling import models

    torch.set_num_threads(1)  # shared cores: one thread is faster (finetune/train/stage.py: cpu_threads)
    model_cfg = models.resolve_model(compose(["model=smollm2_135m", "mode=plan"]).model)
    tokenizer = models.load_tokenizer(model_cfg)
    model = models.load_pretrained(model_cfg, models.model_source(model_cfg), dtype=torch.float32)
    held_out = {m["content"] for r in regression.load() for m in r["messages"] if m["role"] == "user"}
    asked = [p for p in prompts() if p not in held_out]  # the regression checks stay held out
    settings = EvalConfig(
        max_new_tokens=MAX_NEW_TOKENS, batch_size=args.batch_size, greedy=True, progress=True
    )
    answers = generate(
        model, tokenizer, [[{"role": "user", "content": p}] for p in asked], settings, "replay"
    )
    rows = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": _full_sentences(a)}]}
        for p, a in zip(asked, answers)
        if _full_sentences(a)
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} conversations answered by the base to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
