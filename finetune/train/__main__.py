"""Per-rank training worker: what the launcher runs on each process.

    python -m finetune.train RUN_DIR
    torchrun --nproc_per_node=8 -m finetune.train RUN_DIR

Reads the resolved `config.yaml` and `plan.json` from RUN_DIR (written by
`python -m finetune`), trains, and writes RUN_DIR/metrics.json.
"""

from __future__ import annotations

import sys

from finetune.errors import FinetuneError


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m finetune.train RUN_DIR", file=sys.stderr)
        return 2
    from finetune.train.stage import run_worker

    try:
        run_worker(args[0])
    except FinetuneError as exc:
        print(f"finetune.train: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(
            "finetune.train: stopped at once (second signal); the last complete checkpoint is the resume point",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
