"""Generate the bundled chat data set: small checkable tasks a tiny random-init model can learn.

    python scripts/make_bundled_data.py                  # writes finetune/data/bundled/chat.jsonl
    python scripts/make_bundled_data.py --rows 3000 --seed 0 --out PATH

Deterministic: the same seed writes the same bytes. Each row is one conversation
in messages format (`{"messages": [{"role": ..., "content": ...}, ...]}`), some
with a system turn. Every answer is short and exactly checkable
(`finetune.core.tasks.exact_match`), and every task generalises to held-out prompts
(new numbers, or a known word in a new phrasing), so a held-out exact-match
score can rise from zero. The tasks and their phrasings live in `finetune.core.tasks`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.core.tasks import generate  # noqa: E402

DEFAULT_OUT = REPO / "finetune" / "data" / "bundled" / "chat.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = generate(args.rows, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
