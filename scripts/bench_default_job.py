"""Wall and CPU time of the embedded default job (`python -m finetune`), stage by stage.

    python scripts/bench_default_job.py               # 3 runs, medians
    python scripts/bench_default_job.py --runs 1
    python scripts/bench_default_job.py --runs 3 -- train.max_steps=100   # overrides passed to every run

Each run is `python -m finetune` in a fresh run directory (`run_dir=` a new temporary folder), in its own
process, so imports, the data cache left by an earlier run aside, and every stage count as a user sees
them. The stages are timed inside that process by wrapping the pipeline's stage functions
(`finetune/pipeline/stages.py`): plan, data, train, eval and export, and the whole command, in wall seconds
and in CPU seconds (the pipeline's and the ranks'). Prints the median of each over the runs, and each run's
scores as eval/metrics.json holds them (what the job printed), so two versions of the code can be compared
on time and on what they report. `--keep` keeps each run's folder, with the job's whole console output in
output.log.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("plan", "data", "train", "eval", "export")

# Runs in the measured process: wraps each stage function with a timer, runs the real command line, and
# writes the seconds per stage to the file named by the first argument.
TIMED = textwrap.dedent(
    """
    import atexit, json, resource, sys, time
    from finetune.pipeline import cli, stages
    from finetune.data import stage as data_stage

    out, argv = sys.argv[1], sys.argv[2:]
    seconds = {}
    def cpu():
        me, ranks = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + ranks.ru_utime + ranks.ru_stime
    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start, start_cpu = time.perf_counter(), cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
                seconds[name + " cpu"] = seconds.get(name + " cpu", 0.0) + cpu() - start_cpu
        return wrapper
    stages.plan_stage = timed("plan", stages.plan_stage)
    data_stage.run = timed("data", data_stage.run)
    stages.train_stage = timed("train", stages.train_stage)
    stages.eval_stage = timed("eval", stages.eval_stage)
    stages.export_stage = timed("export", stages.export_stage)
    atexit.register(lambda: open(out, "w").write(json.dumps({**seconds, "total cpu": cpu()})))
    sys.exit(cli.main(argv))
    """
)


def _metrics(run_dir: Path) -> list[str]:
    """The scores the job printed, as eval/metrics.json holds them: one line per model variant."""
    path = run_dir / "eval" / "metrics.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    lines = []
    for variant in ("base", "trained", "merged"):
        scores = result.get(variant)
        if isinstance(scores, dict):
            shown = ", ".join(
                f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}"
                for k, v in scores.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            )
            lines.append(f"{variant:8s} {shown}")
    return lines


def one_run(overrides: list[str], keep: bool) -> tuple[dict[str, float], list[str]]:
    """One `python -m finetune` in a fresh run directory: seconds per stage (and `total`), printed metrics."""
    work = Path(tempfile.mkdtemp(prefix="bench_default_job_"))
    times = work / "seconds.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-c", TIMED, str(times), f"run_dir={work / 'run'}", *overrides]
    start = time.perf_counter()
    with open(work / "output.log", "w") as log:
        done = subprocess.run(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    total = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write((work / "output.log").read_text()[-5000:])
        raise SystemExit(f"the default job failed with exit code {done.returncode} (its output is above)")
    seconds = json.loads(times.read_text())
    seconds["total"] = total
    metrics = _metrics(work / "run")
    if keep:
        print(f"run kept in {work}", file=sys.stderr)
    else:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return seconds, metrics


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="how many runs (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory")
    parser.add_argument("overrides", nargs="*", help="key=value overrides passed to every run (after --)")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        seconds, metrics = one_run(args.overrides, args.keep)
        print(f"run {i + 1}/{args.runs}: {seconds['total']:.1f} s", file=sys.stderr)
        runs.append((seconds, metrics))
    print(f"default job (python -m finetune {' '.join(args.overrides)}), {args.runs} run(s), median seconds")
    print(
        "wall: as a user waits; cpu: user + system seconds of the pipeline and the ranks it started (on a shared"
    )
    print(
        "machine the wall clock also counts other tenants' load, the CPU seconds mostly the job's own work)"
    )
    header = "  ".join(f"{'run ' + str(i + 1):>7s}" for i in range(args.runs))
    print(f"{'stage':8s} {'wall':>8s}  {header}  {'cpu':>8s}  {header}")
    for stage in (*STAGES, "total"):
        walls = [seconds.get(stage, 0.0) for seconds, _ in runs]
        cpus = [seconds.get(f"{stage} cpu", 0.0) for seconds, _ in runs]
        print(
            f"{stage:8s} {statistics.median(walls):8.1f}  "
            + "  ".join(f"{v:7.1f}" for v in walls)
            + f"  {statistics.median(cpus):8.1f}  "
            + "  ".join(f"{v:7.1f}" for v in cpus)
        )
    print("printed metrics:")
    for i, (_, metrics) in enumerate(runs):
        for line in metrics:
            print(f"  run {i + 1}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
