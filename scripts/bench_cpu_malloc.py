"""glibc's malloc on the CPU training path: the recipe's measured peak and step time with and without a fixed mmap threshold.

    python scripts/bench_cpu_malloc.py --out /tmp/malloc                  # SmolLM2-135M's recipe, 4 steps a side
    python scripts/bench_cpu_malloc.py --out /tmp/malloc --recipe tiny --steps 6

Each side is the real command line, `python -m finetune +recipe=R mode=data`, then `mode=train` (the launcher
and the training worker; no generation: eval.num_samples=0), in its own run directory; the trainings of all
sides run at the same time, so they share whatever load the machine has. A side's environment sets glibc's
`MALLOC_MMAP_THRESHOLD_` (read at process start, as `mallopt(M_MMAP_THRESHOLD)`) or `MALLOC_TRIM_THRESHOLD_`,
or leaves them unset ("default": glibc's own, dynamic threshold, which the worker keeps). Printed per side, from its
metrics.json: the peak the trainer holds against the plan (`compared_memory_gb`: peak RSS less the RSS
before the data and model load), the plan, their ratio, and the training loop's seconds a step and tokens a second (the first step's start to the
last step's end). A markdown table goes to stdout; --table prints it from the run directories already there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> the environment that side's processes get (glibc reads these once, at start)
SIDES: dict[str, dict[str, str]] = {
    "default": {},
    "mmap-1MiB": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "mmap-256KiB": {"MALLOC_MMAP_THRESHOLD_": str(1 << 18)},
}


def _cli(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    f = open(log, "a")  # noqa: SIM115 - closed by the child's exit; the parent only waits
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", *args],
        stdout=f,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", default="smollm2_135m_lora")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", choices=sorted(SIDES), default=None)
    parser.add_argument("--table", action="store_true", help="print the table of the sides done, run nothing")
    args = parser.parse_args(argv)
    if args.table:
        print(
            _table(args, [n for n in args.only or list(SIDES) if (args.out / n / "metrics.json").is_file()])
        )
        return 0
    names = args.only or list(SIDES)
    args.out.mkdir(parents=True, exist_ok=True)
    common = [
        f"+recipe={args.recipe}", f"train.max_steps={args.steps}", "train.logging_steps=1", "train.warmup_ratio=0",
        "eval.num_samples=0", "eval.progress=false", "train.save_steps=1000", "train.eval_steps=1000",
    ]  # fmt: skip

    def side(name: str) -> list[str]:
        return [*common, f"run_dir={args.out / name}"]

    for name in names:  # the data stage one side after another (the second is a cache hit)
        if _cli([*side(name), "mode=data"], SIDES[name], args.out / f"{name}.log").wait():
            raise SystemExit(f"{name}: mode=data failed; see {args.out / name}.log")
    procs = {name: _cli([*side(name), "mode=train"], SIDES[name], args.out / f"{name}.log") for name in names}
    for name, proc in procs.items():
        if proc.wait():
            raise SystemExit(f"{name}: mode=train failed; see {args.out / name}.log")

    print(_table(args, names))
    return 0


def _table(args: argparse.Namespace, names: list[str]) -> str:
    lines = [
        f"| side ({args.recipe}, {args.steps} steps, all at once) | environment | measured GB | planned GB "
        "| plan against measured | loop s a step | tokens/s | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        t = json.loads((args.out / name / "metrics.json").read_text())["train"]
        env = " ".join(f"{k}={v}" for k, v in SIDES[name].items()) or "-"
        measured, planned = t["compared_memory_gb"], t["planned_memory_gb"]
        lines.append(
            f"| {name} | {env} | {measured:.3f} | {planned:.3f} | {(planned - measured) / measured:+.1%} "
            f"| {t['loop_seconds'] / t['steps']:.1f} | {t['tokens_per_second']:.2f} | {t['final_loss']:.6f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
