"""Memory a record costs in the data stage, for each record kind: a preference pair (DPO), a labelled example
(KTO), a prompt (GRPO), and the same text as a conversation (SFT).

    python scripts/measure_data_memory.py                               # this checkout
    python scripts/measure_data_memory.py --tree /path/to/other/checkout # and another one, for before/after
    python scripts/measure_data_memory.py --records 20000 60000 --kinds dpo sft

For each record kind, JSONL files of N1 and N2 distinct records (a one-line question with two short answers of a
dozen words; SFT and GRPO take the question and the first answer as prompt and completion, KTO the question and
one of the answers with its label), then
`python -m finetune mode=data` on each in a child process (the tiny model's tokenizer, the default data
settings), and the child's peak resident memory (VmHWM). Bytes a record is the slope,
(VmHWM(N2) - VmHWM(N1)) / (N2 - N1), so the interpreter, the libraries and the tokenizer drop out.
Prints one table row per checkout and record kind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The stage run as `python -m finetune` runs it, then its VmHWM written to a file.
_CHILD = """
import sys
from finetune.pipeline.cli import main
try:
    code = main(sys.argv[2:])
finally:
    with open("/proc/self/status") as status:
        hwm = next(int(x.split()[1]) * 1024 for x in status if x.startswith("VmHWM:"))
    with open(sys.argv[1], "w") as out:
        out.write(str(hwm))
sys.exit(code)
"""


# The objective each record kind is measured under, and how the table names it.
KINDS = {
    "dpo": (("objective=dpo",), "preferences (DPO)"),
    "kto": (("objective=kto",), "labelled (KTO)"),
    "grpo": (("objective=grpo", "objective.num_generations=4"), "prompts (GRPO)"),
    "sft": (("objective=sft",), "conversations (SFT)"),
}


def write_records(path: Path, n: int, kind: str) -> None:
    """`n` distinct records: preference pairs (`dpo`), a labelled answer (`kto`: the first or the second by
    turns), or the same question and first answer (`sft`, `grpo`)."""
    vocab = [f"word{i}" for i in range(2000)]
    with path.open("w") as f:
        for i in range(n):
            rng = random.Random(i)
            question = f"question {i}: " + " ".join(rng.choices(vocab, k=8))
            chosen, rejected = (" ".join(rng.choices(vocab, k=12)) for _ in range(2))
            if kind == "dpo":
                record = {"prompt": question, "chosen": chosen, "rejected": rejected}
            elif kind == "kto":
                record = {"prompt": question, "completion": (chosen, rejected)[i % 2], "label": i % 2 == 0}
            else:
                record = {"prompt": question, "completion": chosen}
            f.write(json.dumps(record) + "\n")


def peak_bytes(tree: Path, data: Path, work: Path, kind: str) -> int:
    """The VmHWM of `mode=data` on `data` run from `tree`."""
    run_dir = work / f"run-{data.stem}-{abs(hash(str(tree)))}"
    hwm = run_dir.with_suffix(".vmhwm")
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "FINETUNE_CACHE": str(work / "models"),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-c", _CHILD, str(hwm), "mode=data", f"data.path={data}", f"run_dir={run_dir}"]
    argv += [f"data.cache_dir={run_dir}-cache", *KINDS[kind][0]]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mode=data failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return int(hwm.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, nargs=2, default=[20_000, 60_000], metavar=("N1", "N2"))
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another checkout to measure too")
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    args = ap.parse_args()
    n1, n2 = args.records
    rows = []
    with tempfile.TemporaryDirectory(prefix="measure-data-memory-") as tmp:
        work = Path(tmp)
        for tree in [REPO, *args.tree]:
            for kind in args.kinds:
                peaks = []
                for n in (n1, n2):
                    data = work / f"{kind}-{n}.jsonl"
                    if not data.is_file():
                        write_records(data, n, kind)
                    peaks.append(peak_bytes(tree.resolve(), data, work, kind))
                    print(f"  {tree} {kind} {n:,}: VmHWM {peaks[-1] / 1e6:,.0f} MB", file=sys.stderr)
                rows.append((tree, kind, peaks, (peaks[1] - peaks[0]) / (n2 - n1)))
    print(f"data stage memory a record ({os.cpu_count()} CPUs; {n1:,} and {n2:,} records)")
    print(f"| checkout | record kind | VmHWM at {n1:,} MB | VmHWM at {n2:,} MB | bytes a record |")
    print("|---|---|---:|---:|---:|")
    for tree, kind, peaks, slope in rows:
        name = "this checkout" if tree == REPO else str(tree)
        label = KINDS[kind][1]
        print(f"| {name} | {label} | {peaks[0] / 1e6:,.0f} | {peaks[1] / 1e6:,.0f} | {slope:,.0f} |")


if __name__ == "__main__":
    main()
