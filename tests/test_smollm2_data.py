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
