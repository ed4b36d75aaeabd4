"""How long planning takes: the planner itself, and the whole `mode=plan` command.

    python scripts/bench_plan.py            # every recipe, 20 repeats each, plus 5 CLI runs
    python scripts/bench_plan.py --repeats 5 --cli-runs 2

Prints a markdown table of medians. The target: planning well under
a second after start-up; the CLI row shows what start-up (Hydra, imports) adds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune.core.composition import (  # noqa: E402
    compose,
    load_profiles,
    recipe_names,  # noqa: E402
)
from finetune.planner import make_plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cli-runs", type=int, default=5)
    args = parser.parse_args()

    profiles = load_profiles()
    print("| what | median ms | min ms | fits |")
    print("|---|---:|---:|---|")
    for recipe in recipe_names():
        for hardware in (None, "auto"):
            overrides = [f"+recipe={recipe}", "mode=plan"] + ([f"hardware={hardware}"] if hardware else [])
            cfg = compose(overrides)
            if cfg.hardware.gpu_memory_gb is None and not cfg.hardware.is_auto:
                continue  # hardware=cpu: memory is read at run time, covered by the CLI row
            times, plan = [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, profiles)
                times.append((time.perf_counter() - t0) * 1e3)
            label = f"make_plan {recipe}" + (" hardware=auto" if hardware else "")
            print(
                f"| {label} | {statistics.median(times):.2f} | {min(times):.2f} | {plan.fits if plan else '-'} |"
            )
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.cli_runs):
            t0 = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "finetune",
                    "+recipe=llama70b_qlora",
                    "mode=plan",
                    f"run_dir={tmp}/run",
                ],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            times.append((time.perf_counter() - t0) * 1e3)
    print(
        f"| CLI `python -m finetune +recipe=llama70b_qlora mode=plan` (start-up included) | "
        f"{statistics.median(times):.0f} | {min(times):.0f} | True |"
    )


if __name__ == "__main__":
    main()
