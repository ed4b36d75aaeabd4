"""glibc's malloc on the CPU training path: each recipe's measured peak and step time against its plan, with
and without a fixed mmap threshold, side by side.

    python scripts/bench_cpu_malloc.py --out /tmp/malloc --rows smollm2 --steps 3          # SmolLM2-135M's recipe
    python scripts/bench_cpu_malloc.py --out /tmp/malloc --rows sft-lora dpo-lora --sides default mmap-4MiB
    python scripts/bench_cpu_malloc.py --out /tmp/malloc --table      # reprint what the run directories hold

A row is a recipe with its overrides, run as the user runs it: `python -m finetune ... mode=data`, then
`mode=train` (the launcher and the training worker; no generation: eval.num_samples=0), each side in its own
run directory. The trainings of all sides of one row run at the same time, so they share whatever load the
machine has; `--repeats` runs the row again after. A side's environment sets glibc's `MALLOC_MMAP_THRESHOLD_`
(read at process start, as `mallopt(M_MMAP_THRESHOLD)`: the threshold is then fixed, glibc's dynamic one off),
or leaves it unset ("default": glibc's own threshold, which rises to the largest block freed, up to 32 MiB).

Printed per run, from its metrics.json and plan.json: the peak (the worker's VmHWM, `peak_memory_gb`), the same
less the RSS before the data and model load (`compared_memory_gb`), the plan's total and its tensors (the total
less the overhead term), the plan against the peak, and the median seconds of the steps after the first.
`--json` writes the rows for scripts/calibrate.py --cpu-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent

# name -> the environment that side's processes get (glibc reads it once, at start)
SIDES: dict[str, dict[str, str]] = {
    "default": {},
    # glibc's default again: repeats that run at the same time as the first (the run-to-run spread)
    "default-2": {},
    "default-3": {},
    "mmap-64KiB": {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)},
    "mmap-256KiB": {"MALLOC_MMAP_THRESHOLD_": str(256 << 10)},
    "mmap-1MiB": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "mmap-4MiB": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)},
    "mmap-16MiB": {"MALLOC_MMAP_THRESHOLD_": str(16 << 20)},
    "mmap-32MiB": {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
}

# name -> the recipe's command-line overrides (the smoke tests' tiny methods, the DPO and GRPO recipes, SmolLM2)
ROWS: dict[str, tuple[str, ...]] = {
    "sft-lora": ("+recipe=tiny", "method=lora"),
    "sft-qlora": ("+recipe=tiny", "method=qlora"),
    "sft-full": ("+recipe=tiny", "method=full"),
    "dpo-full": ("+recipe=tiny_dpo", "method=full", "train.seq_len=auto"),
    "dpo-lora": ("+recipe=tiny_dpo", "method=lora", "train.seq_len=auto"),
    "dpo-qlora": ("+recipe=tiny_dpo", "method=qlora", "train.seq_len=auto"),
    "grpo": ("+recipe=tiny_grpo",),
    "smollm2": ("+recipe=smollm2_135m_lora",),
}


def _cli(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    f = open(log, "a")  # noqa: SIM115 - closed by the child's exit; the parent only waits
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", *args],
        stdout=f,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )


def _run_dir(out: Path, row: str, side: str, repeat: int) -> Path:
    return out / f"{row}.{side}.{repeat}"


def run_row(out: Path, row: str, sides: list[str], repeat: int, steps: int) -> None:
    common = [
        *ROWS[row], f"train.max_steps={steps}", "train.logging_steps=1", "train.warmup_ratio=0",
        "eval.num_samples=0", "eval.progress=false", "train.save_steps=1000", "train.eval_steps=1000",
        f"data.cache_dir={out / 'cache'}",
    ]  # fmt: skip

    def args(side: str) -> list[str]:
        return [*common, f"run_dir={_run_dir(out, row, side, repeat)}"]

    logs = {side: out / f"{row}.{side}.{repeat}.log" for side in sides}
    for side in sides:  # the data stage one side after another (the later ones are cache hits)
        if _cli([*args(side), "mode=data"], SIDES[side], logs[side]).wait():
            raise SystemExit(f"{row} {side}: mode=data failed; see {logs[side]}")
    procs = {side: _cli([*args(side), "mode=train"], SIDES[side], logs[side]) for side in sides}
    for side, proc in procs.items():
        if proc.wait():
            raise SystemExit(f"{row} {side}: mode=train failed; see {logs[side]}")


def plan_split(run_dir: Path, cal=None) -> dict[str, float]:
    """The run's plan (its config.yaml at plan.json's rows) as the CPU overhead's parts (GB): the tensors with
    the working set above the loss, the fluctuating bytes `allocator_fraction` multiplies, the adapters'
    freed heap-sized outputs `retained_adapter_outputs` multiplies, and the total with `cal` (default: the
    shipped calibration)."""
    from dataclasses import replace
    from unittest import mock

    from finetune.pipeline.stages import config_plan
    from finetune.planner.calibration import Calibration
    from finetune.rundir.state import load_config

    cfg = load_config(run_dir)
    seq_len = json.loads((run_dir / "plan.json").read_text())["seq_len"]
    shipped = cal or Calibration.default()

    def total(**cpu: float) -> float:
        changed = replace(shipped, cpu=replace(shipped.cpu, **cpu))
        with mock.patch.object(Calibration, "default", staticmethod(lambda: changed)):
            return config_plan(cfg, seq_len=seq_len).gpu_memory.total

    zero = dict(fixed_gb=0.0, allocator_fraction=0.0, retained_adapter_outputs=0.0)
    # an unfitted CPU section, for comparison: the process 0.6 GB, 5% of the fluctuating
    before = dict(fixed_gb=0.6, allocator_fraction=0.05, retained_adapter_outputs=0.0)
    tensors = total(**zero)
    return {
        "tensors": tensors,
        "fluctuating": total(**{**zero, "allocator_fraction": 1.0}) - tensors,
        "adapter_outputs": total(**{**zero, "retained_adapter_outputs": 1.0}) - tensors,
        "total": total(),
        "total_before": total(**before),
    }


FIT_UNDER = 0.01  # the adapters' share is fitted so that no row's plan is more than 1% under its median peak


def _by_row(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Runs grouped by row and side; glibc's default repeats (default, default-2, ...) are one side."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        side = "default" if r["side"].startswith("default") else r["side"]
        groups.setdefault((r["row"], side), []).append(r)
    return groups


def fit(runs: list[dict], imports: Optional[float] = None) -> dict[str, float]:
    """cpu.fixed_gb, allocator_fraction and retained_adapter_outputs from the glibc-default runs.

    The process's share: the largest peak beyond the tensors of any full fine-tuning run (no adapters, so no
    retained outputs), less the installed optional libraries' imports (`imports` GB; None: those installed here,
    cpu.library_imports_gb). The fluctuating share: 0, since the full rows' peak beyond the tensors does not grow with
    their fluctuating bytes (measured at 0.06 and 0.19 GB). The adapters' retained outputs: the smallest share of
    their heap-sized outputs that keeps every adapter row's plan at most FIT_UNDER under its median peak.
    """
    default = {row: rs for (row, side), rs in _by_row(runs).items() if side == "default"}
    if imports is None:  # the installed optional libraries' imports: their own term, not the process's
        from finetune.planner.calibration import Calibration

        cal = Calibration.default()
        imports = sum(cal.cpu.library_imports_gb[name] for name in cal.installed("cpu"))
    fixed = max(
        r["peak_gb"] - r["tensors_gb"] - imports
        for rs in default.values()
        for r in rs
        if not r["adapter_outputs_gb"]
    )
    needed = [
        (
            (1 - FIT_UNDER) * statistics.median(r["peak_gb"] for r in rs)
            - fixed
            - imports
            - rs[0]["tensors_gb"]
        )
        / rs[0]["adapter_outputs_gb"]
        for rs in default.values()
        if rs[0]["adapter_outputs_gb"]
    ]
    return {
        "fixed_gb": round(fixed, 3),
        "allocator_fraction": 0.0,
        "retained_adapter_outputs": round(max(0.0, *needed), 2),
    }


def measured(out: Path) -> list[dict]:
    """Every finished run under `out`: its row, side, repeat and figures."""
    runs = []
    for metrics in sorted(out.glob("*.*.*/metrics.json")):
        row, side, repeat = metrics.parent.name.split(".")
        t = json.loads(metrics.read_text())["train"]
        plan = json.loads((metrics.parent / "plan.json").read_text())["gpu_memory_gb"]
        later = t.get("step_seconds", [])[1:]
        split = plan_split(metrics.parent)
        runs.append(
            {
                "row": row,
                "side": side,
                "repeat": int(repeat),
                "peak_gb": t["peak_memory_gb"],
                "compared_gb": t["compared_memory_gb"],
                "baseline_gb": round(t["peak_memory_gb"] - t["compared_memory_gb"], 4),
                "planned_gb": t["planned_memory_gb"],
                "plan_tensors_gb": round(plan["total"] - plan["overhead"], 4),
                "plan_overhead_gb": plan["overhead"],
                "plan_activations_gb": plan["activations"],
                "plan_logits_gb": plan["logits"],
                # the same plan recomputed here: tensors with the working set above the loss, the fluctuating
                # bytes, the total with the shipped calibration (the GRPO plan adds its rollout to plan.json's)
                "tensors_gb": round(split["tensors"], 4),
                "fluctuating_gb": round(split["fluctuating"], 4),
                "adapter_outputs_gb": round(split["adapter_outputs"], 4),
                "replanned_gb": round(split["total"], 4),
                "planned_before_gb": round(split["total_before"], 4),
                "step_s_median": statistics.median(later)
                if later
                else t["loop_seconds"] / max(1, t["steps"]),
                "final_loss": t["final_loss"],
            }
        )
    return runs


def table(runs: list[dict]) -> str:
    lines = [
        "| row | side | runs | peak GB (VmHWM), median [min-max] | baseline GB | plan before GB | error "
        "| plan now GB (tensors + overhead) | error | median s a step (after the first) | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(ROWS)}
    for (row, side), rs in sorted(_by_row(runs).items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
        peaks = [r["peak_gb"] for r in rs]
        peak, then, now = statistics.median(peaks), rs[0]["planned_before_gb"], rs[0]["replanned_gb"]
        lines.append(
            f"| {row} | {side} | {len(rs)} | {peak:.3f} [{min(peaks):.3f}-{max(peaks):.3f}] "
            f"| {statistics.median(r['baseline_gb'] for r in rs):.3f} | {then:.3f} | {(then - peak) / peak:+.1%} "
            f"| {now:.3f} ({rs[0]['tensors_gb']:.3f} + {now - rs[0]['tensors_gb']:.3f}) | {(now - peak) / peak:+.1%} "
            f"| {statistics.median(r['step_s_median'] for r in rs):.2f} | {rs[0]['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", nargs="*", choices=sorted(ROWS), default=["smollm2"])
    parser.add_argument("--sides", nargs="*", choices=sorted(SIDES), default=["default", "mmap-4MiB"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--table", action="store_true", help="print the table of the runs done, run nothing")
    parser.add_argument("--fit", action="store_true", help="print the cpu calibration these runs ask for")
    args = parser.parse_args(argv)
    if not args.table:
        args.out.mkdir(parents=True, exist_ok=True)
        for row in args.rows:
            for repeat in range(args.repeats):
                run_row(args.out, row, args.sides, repeat, args.steps)
    runs = measured(args.out)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(table(runs))
    if args.fit:
        print("\nfitted on the glibc-default runs:", json.dumps(fit(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
