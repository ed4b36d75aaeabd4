"""Generate the bundled preference set from the bundled chat data: the right answer chosen, the wrong one rejected.

    python scripts/make_bundled_preferences.py          # writes finetune/data/bundled/preferences.jsonl
    python scripts/make_bundled_preferences.py --rows 1200 --out PATH

Deterministic: the same input writes the same bytes. Each row is one pair in TRL's conversational
preference format: `prompt` (the conversation up to its answer, with its system turn if any), `chosen`
(the correct answer, an assistant turn) and `rejected` (the task's other answer: `odd` for `even`,
`negative` for `positive`). Both tasks have exactly two answers, so the pair is checkable: a model has
learned the preference when the chosen answer becomes the more likely one on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.modeling.tiny import bundled_data_path  # noqa: E402

DEFAULT_OUT = REPO / "finetune" / "data" / "bundled" / "preferences.jsonl"
# Each task's two answers: the rejected answer is the other one.
OTHER = {"even": "odd", "odd": "even", "positive": "negative", "negative": "positive"}


def pairs(rows: int) -> list[dict]:
    out = []
    with open(bundled_data_path(), encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            answer = messages[-1]["content"]
            out.append(
                {
                    "prompt": messages[:-1],
                    "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": OTHER[answer]}],
                }
            )
            if len(out) == rows:
                break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1200, help="pairs to write (the first N conversations)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = pairs(args.rows)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {len(rows)} pairs to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
