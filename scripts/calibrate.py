"""Refit the planner's calibration constants from a GPU check's results.

    python scripts/calibrate.py RESULTS.json                       # update finetune/planner/calibration.json
    python scripts/calibrate.py RESULTS.json --dry-run             # only show the before/after errors
    python scripts/calibrate.py RESULTS.json --calibration COPY.json

RESULTS.json is what scripts/gpu_check.py writes. What a GPU check can inform:

- cuda_context_gb: what the device holds beyond PyTorch's cache (measured per
  case as device memory in use minus memory_reserved); the largest seen;
- allocator_fraction: the reserved-but-not-allocated share and the working set
  the terms leave out, as a fraction of the terms' sum; fitted so that the
  plan's total covers every measured device peak (reserved + context): the
  planner must never say a job fits that does not;
- cpu_process_gb (from a `--cpu` run): the RSS peak beyond the terms.

Prints each case's plan total before and after against the measured peak,
then writes the file atomically (a temporary file renamed over it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

DEFAULT_PATH = ROOT / "finetune" / "planner" / "calibration.json"


def load(path: Path) -> tuple[dict[str, Any], Any]:
    from finetune.planner.core import Calibration

    raw = json.loads(path.read_text())
    return raw, Calibration(**{k: v for k, v in raw.items() if not k.startswith("_")})


def fit(rows: list[dict[str, Any]], cal: Any) -> tuple[Any, list[str]]:
    """New constants from the measured rows; returns the calibration and one line per change."""
    from gpu_check import plan_terms

    notes: list[str] = []
    gpu = [r for r in rows if "max_reserved_gb" in r["result"]]
    cpu = [r for r in rows if "rss_peak_gb" in r["result"]]
    new = cal
    if gpu:
        context = max(r["result"]["context_gb"] for r in gpu)
        fractions = []
        for r in gpu:
            p = plan_terms(r["case"], cal)
            four = p["total"] - p["overhead"]  # the allocator's share is a fraction of these
            fractions.append((r["result"]["max_reserved_gb"] - p["tensors"]) / four)
        fraction = min(max(max(fractions), 0.0), 0.5)
        new = replace(new, cuda_context_gb=round(context, 3), allocator_fraction=round(fraction, 4))
        notes.append(
            f"cuda_context_gb {cal.cuda_context_gb} -> {new.cuda_context_gb} (largest of {len(gpu)} cases)"
        )
        notes.append(
            f"allocator_fraction {cal.allocator_fraction} -> {new.allocator_fraction} "
            f"(covers every case's max_memory_reserved; per case {', '.join(f'{x:+.3f}' for x in fractions)})"
        )
    if cpu:
        extra = []
        for r in cpu:
            p = plan_terms(r["case"], cal)
            four = p["total"] - p["overhead"]
            extra.append(r["result"]["rss_peak_gb"] - p["tensors"] - four * new.allocator_fraction)
        process = round(max(max(extra), 0.0), 3)
        notes.append(
            f"cpu_process_gb {cal.cpu_process_gb} -> {process} (RSS peak beyond the terms, largest of {len(cpu)})"
        )
        new = replace(new, cpu_process_gb=process)
    return new, notes


def error_table(rows: list[dict[str, Any]], before: Any, after: Any) -> str:
    from gpu_check import plan_terms

    lines = [
        "| case | measured peak GB | plan before GB | error before | plan after GB | error after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = r["result"]["device_peak_gb"]
        b, a = plan_terms(r["case"], before)["total"], plan_terms(r["case"], after)["total"]
        lines.append(
            f"| {r['case']['name']} | {measured:.3f} | {b:.3f} | {(b - measured) / measured:+.1%} "
            f"| {a:.3f} | {(a - measured) / measured:+.1%} |"
        )
    return "\n".join(lines)


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path)
    parser.add_argument("--calibration", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    results = json.loads(args.results.read_text())
    rows = [r for r in results["rows"] if r["result"].get("status") == "ok"]
    if not rows:
        print(f"{args.results}: no successful case to calibrate from", file=sys.stderr)
        return 2
    raw, before = load(args.calibration)
    after, notes = fit(rows, before)
    print("\n".join(notes) + "\n")
    print(error_table(rows, before, after))
    if args.dry_run:
        print("\n--dry-run: nothing written")
        return 0
    meta = results.get("meta", {})
    out = dict(raw)
    out.update({k: v for k, v in asdict(after).items() if k in raw})
    out["_calibrated"] = (
        f"{datetime.date.today().isoformat()}: scripts/calibrate.py {args.results.name} "
        f"({meta.get('device', '?')}, {(meta.get('gpu') or {}).get('name', 'no GPU')}, {len(rows)} cases)"
    )
    write_atomic(args.calibration, out)
    print(f"\nwrote {args.calibration}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
