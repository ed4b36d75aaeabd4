"""SmolLM2's training mix keeps the regression set held out: no regression prompt is trained on.

The recipe `+recipe=smollm2_135m_lora` trains on finetune/data/smollm2 (the task and the checked replay,
scripts/make_replay_data.py); the regression checks it is scored on (finetune/data/regression/prompts.jsonl)
only measure what it kept if none of their prompts, nor their exact answers asked the same way, is in that mix.
No model is loaded: the files as committed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune.evaluation import regression

MIX = Path(__file__).resolve().parent.parent / "finetune" / "data" / "smollm2"


def _norm(text: str) -> str:
    """Case, punctuation and spacing folded: "What is 7 + 7?" and "what is 7+7" are one prompt."""
    return re.sub(r"[^a-z0-9+*/=-]", "", text.lower())


def _user_turns(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]


def test_no_regression_prompt_is_in_the_smollm2_training_mix():
    files = sorted(MIX.glob("*.jsonl"))
    assert [f.name for f in files] == ["replay.jsonl", "task.jsonl"]
    trained = {_norm(t) for f in files for t in _user_turns(f)}
    held_out = {
        r["id"]: _norm(m["content"]) for r in regression.load() for m in r["messages"] if m["role"] == "user"
    }
    assert len(held_out) == 33 and len(trained) > 500
    assert sorted(i for i, p in held_out.items() if p in trained) == []
    # the replay is near the regression kinds without being them: capitals, sums, translations, lists asked
    replay = [_norm(t) for t in _user_turns(MIX / "replay.jsonl")]
    for kind in ("whatisthecapitalof", "plus", "times", "translate", "listthree"):
        assert sum(kind in p for p in replay) >= 8, kind


def _replay() -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in (MIX / "replay.jsonl").read_text().splitlines() if line.strip()]
    return [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in rows]


def test_the_replay_near_the_regression_kinds_is_right_and_keeps_their_facts_out():
    """The replay's kinds nearest the regression set (time units, sums asked with "+", doubling and small products, words into English)
    are answered right in one sentence, and none trains a regression check's own fact in another wording."""
    replay = _replay()
    sums = [
        (int(m[1]), int(m[2]), a) for p, a in replay if (m := re.fullmatch(r"What is (\d+) \+ (\d+)\?", p))
    ]
    products = [
        (int(m[1]), int(m[2]), a) for p, a in replay if (m := re.fullmatch(r"What is (\d+) times (\d+)\?", p))
    ]
    assert len(sums) >= 15 and all(a == f"{x} + {y} = {x + y}." for x, y, a in sums)
    # the base's own answers to the older "times" prompts are kept where right ("7 times 17 is 119.")
    assert len(products) >= 30 and all(re.search(rf"\b{x * y}\b", a) for x, y, a in products)
    assert {tuple(sorted(s[:2])) for s in sums} & {(2, 3), (7, 7)} == set()
    assert {tuple(sorted(p[:2])) for p in products} & {(3, 4), (2, 5)} == set()
    halves = {p: a for p, a in replay if p.startswith("What is half of")}
    assert len(halves) >= 5 and "What is half of 10?" not in halves
    assert halves["What is half of 14?"] == "Half of 14 is 7."
    meanings = {p: a for p, a in replay if p.endswith("mean in English?")}
    assert len(meanings) >= 30
    assert meanings["What does 'gato' mean in English?"] == '"Gato" means "cat" in English.'
    assert meanings["What does 'adiós' mean in English?"] == '"Adiós" means "goodbye" in English.'
    hours = {p: a for p, a in replay if re.match(r"How many (hours|minutes|seconds|days|weeks) are in", p)}
    assert hours["How many hours are in a week?"] == "There are 168 hours in a week."
    assert len(hours) >= 14
    # the regression's greetings, dog and thanks, its 24-hour day and 7-day week: in no replay turn
    text = "\n".join(f"{p}\n{a}" for p, a in replay).lower()
    for fact in ("hola", "bonjour", "perro", "merci", "gracias", "24 hours", "7 days", "hours in a day"):
        assert fact not in text, fact
