"""Derive the bundled KTO set from the bundled preference pairs: each pair's two answers as unpaired examples.

    python scripts/make_bundled_labelled.py          # writes finetune/data/bundled/labelled.jsonl
    python scripts/make_bundled_labelled.py --out PATH --seed 0

Deterministic: the same input and seed write the same bytes. Each pair becomes two rows in TRL's
conversational unpaired-preference format: `prompt` with its `chosen` answer as the `completion`, `label`
true (desirable), and the same prompt with its `rejected` answer, `label` false (undesirable); so the set
keeps the pairs' ratio, one desirable to one undesirable (KTO's default weights of 1.0 fit it). The rows are
shuffled with the seed, so that neighbours hold different prompts: TRL's KL estimate pairs each prompt with
its neighbour's completion in the batch (the data stage orders the rows again, by the seed of data.seed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.modeling.tiny import bundled_data_path  # noqa: E402

DEFAULT_OUT = REPO / "finetune" / "data" / "bundled" / "labelled.jsonl"


def unpaired(seed: int) -> list[dict]:
    rows = []
    with open(bundled_data_path("preferences"), encoding="utf-8") as f:
        for line in f:
            pair = json.loads(line)
            rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
            rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    random.Random(seed).shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = unpaired(args.seed)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(args.out)
    desirable = sum(r["label"] for r in rows)
    print(
        f"wrote {len(rows)} examples to {args.out} ({desirable} desirable, {len(rows) - desirable} undesirable)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
