"""Refit the planner's per-device calibration from measured training steps.

    python scripts/calibrate.py RESULTS.json [MORE.json ...]          # update finetune/planner/calibration.json
    python scripts/calibrate.py RESULTS.json --dry-run                 # only show the before/after errors
    python scripts/calibrate.py RESULTS.json --calibration COPY.json
    python scripts/calibrate.py scripts/gpu_results/h200-issue13.json  # the stored H200 measurements

RESULTS.json is what scripts/gpu_check.py writes (or the same shape: rows of
{case, result}); every case describes what ran (method, shape, strategy, and
the harness's `autocast` and `packed`), so the planner's memory model is
evaluated for exactly that. What the rows inform, for their device kind:

- cuda.backward_working_set_layers: the transient gradients of one layer's
  backward, as a fraction of its saved activations; least squares of the
  relative error of the planned tensors against max_memory_allocated;
- cuda.fixed_gb: the CUDA context (device memory in use beyond PyTorch's
  reserved memory), the largest measured; kept when no row measured it;
- cuda.allocator_fraction: the reserved-but-unallocated share, as a fraction of
  what a step allocates and frees (activations, the loss, the working set, the
  gradients; not the weights and states allocated once): the smallest that
  keeps every plan total at most 2% below its measured device peak (one point
  inside the 3% target) (max_memory_reserved + context; for rows that only
  recorded max_memory_allocated, allocated + the context they name, a lower
  bound of their device peak). `--residuals` prints, for the rows that measured
  reserved memory, the reserved-but-unallocated bytes against both what the
  share could scale with (the step's fluctuating bytes, or every term);
- cuda.utilisation (per method): tokens/s x executed FLOPs a token / the dense
  bf16 peak, the median over the chunked-loss rows of that method;
- cuda.trl_loss_extra_hv_flops: the time TRL's fused LM head takes beyond the
  chunked loss, in h x V FLOPs a token, the median over the TRL-loss rows;
- cpu.fixed_gb (from a `--cpu` run): the RSS peak beyond the terms of a plain process. The shipped cpu
  section's fixed_gb, allocator_fraction and retained_adapter_outputs come instead from whole runs through the
  training worker (`scripts/bench_cpu_malloc.py --fit`), whose libraries a plain process lacks.

Prints each case's plan total before and after against the measured peak, and
writes the file atomically (a temporary file renamed over it). A row whose
loss path no plan takes (`loss: transformers`) is shown and not fitted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

DEFAULT_PATH = ROOT / "finetune" / "planner" / "calibration.json"
TOTAL_OVER, TOTAL_UNDER = 0.10, 0.03  # the target: every total within +10% and -3% of the device peak
FIT_UNDER = (
    0.02  # the allocator share is fitted to -2%: one point inside the target, for the next measurement
)


def load(path: Path) -> tuple[dict[str, Any], Any]:
    from finetune.planner import Calibration

    raw = json.loads(path.read_text())
    return raw, Calibration.from_dict(raw)


def device_peak(row: dict[str, Any]) -> Optional[float]:
    """The measured device peak (GB): reserved + context, RSS on the CPU, or allocated + the named context."""
    res = row["result"]
    if res.get("device_peak_gb") is not None:
        return float(res["device_peak_gb"])
    if res.get("max_allocated_gb") is not None and res.get("context_gb_assumed") is not None:
        return float(res["max_allocated_gb"]) + float(res["context_gb_assumed"])
    return None


def plannable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from gpu_check import plan_terms

    return [r for r in rows if plan_terms(r["case"]) is not None]


def _with_cuda(cal: Any, **changes: Any) -> Any:
    return replace(cal, cuda=replace(cal.cuda, **changes))


def fit_cuda(rows: list[dict[str, Any]], cal: Any) -> tuple[Any, list[str]]:
    """New cuda constants from the measured GPU rows; returns the calibration and one line per change."""
    from gpu_check import executed_flops, plan_terms

    notes: list[str] = []
    alloc_rows = [r for r in rows if r["result"].get("max_allocated_gb")]

    def rel_err(c: Any) -> float:
        errs = []
        for r in alloc_rows:
            a = r["result"]["max_allocated_gb"]
            errs.append(((plan_terms(r["case"], c)["tensors"] - a) / a) ** 2)
        return sum(errs)

    k = min(
        (i / 100 for i in range(0, 151)),
        key=lambda x: rel_err(_with_cuda(cal, backward_working_set_layers=x)),
    )
    new = _with_cuda(cal, backward_working_set_layers=k)
    notes.append(
        f"cuda.backward_working_set_layers {cal.cuda.backward_working_set_layers} -> {k} "
        f"(least squares of the tensors' relative error over {len(alloc_rows)} rows)"
    )
    contexts = [r["result"]["context_gb"] for r in rows if r["result"].get("context_gb") is not None]
    if contexts:
        new = _with_cuda(new, fixed_gb=round(max(contexts), 3))
        notes.append(f"cuda.fixed_gb {cal.cuda.fixed_gb} -> {new.cuda.fixed_gb} (largest measured context)")
    peaks = [(r, device_peak(r)) for r in rows if device_peak(r) is not None]
    if peaks:
        needed = []
        for r, peak in peaks:
            p = plan_terms(r["case"], _with_cuda(new, allocator_fraction=0.0))
            needed.append(((1 - FIT_UNDER) * peak - p["total"]) / p["fluctuating"])
        fraction = round(min(max(max(needed), 0.0), 0.5) + 0.0005, 3)
        new = _with_cuda(new, allocator_fraction=fraction)
        notes.append(
            f"cuda.allocator_fraction {cal.cuda.allocator_fraction} -> {fraction} (no total more than "
            f"{FIT_UNDER:.0%} below its device peak; needed per row {', '.join(f'{x:+.3f}' for x in needed)})"
        )
    timed = [r for r in rows if r["result"].get("tokens_per_s") and r["case"].get("peak_bf16_tflops")]
    utilisation = dict(new.cuda.utilisation)
    for method in sorted({r["case"]["method"] for r in timed}):
        chunked = [r for r in timed if r["case"]["method"] == method and r["case"]["chunked_loss"]]
        if not chunked:
            continue
        per_row = [_utilisation(r, executed_flops(r["case"], new)) for r in chunked]
        utilisation[method] = round(statistics.median(per_row), 4)
        notes.append(
            f"cuda.utilisation.{method} {cal.cuda.utilisation.get(method)} -> {utilisation[method]} "
            f"(median of {', '.join(f'{x:.1%}' for x in per_row)})"
        )
    new = _with_cuda(new, utilisation=utilisation)
    trl = [r for r in timed if not r["case"]["chunked_loss"] and r["case"]["method"] in utilisation]
    if trl:
        extras = []
        for r in trl:
            c = r["case"]
            base = executed_flops(dict(c, chunked_loss=True), new)
            needed_flops = (
                utilisation[c["method"]] * c["peak_bf16_tflops"] * 1e12 / r["result"]["tokens_per_s"]
            )
            m = _model(c)
            extras.append((needed_flops - base) / (m.hidden_size * m.vocab_size))
        extra = round(max(statistics.median(extras), 0.0), 2)
        new = _with_cuda(new, trl_loss_extra_hv_flops=extra)
        notes.append(
            f"cuda.trl_loss_extra_hv_flops {cal.cuda.trl_loss_extra_hv_flops} -> {extra} "
            f"(median of {', '.join(f'{x:.2f}' for x in extras)})"
        )
    return new, notes


def _model(case: dict[str, Any]) -> Any:
    from gpu_check import model_config

    return model_config(case)


def _utilisation(row: dict[str, Any], flops_per_token: float) -> float:
    return row["result"]["tokens_per_s"] * flops_per_token / (row["case"]["peak_bf16_tflops"] * 1e12)


def fit_cpu(rows: list[dict[str, Any]], cal: Any) -> tuple[Any, list[str]]:
    from gpu_check import plan_terms

    extra = []
    for r in rows:
        p = plan_terms(r["case"], cal)
        extra.append(
            r["result"]["rss_peak_gb"] - p["tensors"] - p["fluctuating"] * cal.cpu.allocator_fraction
        )
    process = round(max(max(extra), 0.0), 3)
    note = f"cpu.fixed_gb {cal.cpu.fixed_gb} -> {process} (RSS peak beyond the terms, largest of {len(rows)})"
    return replace(cal, cpu=replace(cal.cpu, fixed_gb=process)), [note]


def fit(rows: list[dict[str, Any]], cal: Any) -> tuple[Any, list[str]]:
    """New constants from the measured rows; returns the calibration and one line per change."""
    rows = plannable(rows)
    gpu = [r for r in rows if r["result"].get("max_allocated_gb") is not None]
    cpu = [r for r in rows if "rss_peak_gb" in r["result"]]
    notes: list[str] = []
    new = cal
    if gpu:
        new, more = fit_cuda(gpu, new)
        notes += more
    if cpu:
        new, more = fit_cpu(cpu, new)
        notes += more
    return new, notes


def error_table(rows: list[dict[str, Any]], before: Any, after: Any) -> str:
    from gpu_check import plan_terms

    lines = [
        "| case | measured peak GB | plan before GB | error before | plan after GB | error after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = device_peak(r)
        b, a = plan_terms(r["case"], before), plan_terms(r["case"], after)
        if measured is None:
            continue
        if a is None or b is None:
            lines.append(
                f"| {r['case']['name']} | {measured:.3f} | - | no plan takes this loss path | - | - |"
            )
            continue
        lines.append(
            f"| {r['case']['name']} | {measured:.3f} | {b['total']:.3f} | {(b['total'] - measured) / measured:+.1%} "
            f"| {a['total']:.3f} | {(a['total'] - measured) / measured:+.1%} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]], cal: Any) -> str:
    """Whether every plannable total is within the target of its device peak."""
    from gpu_check import plan_terms

    errs = []
    for r in rows:
        peak, p = device_peak(r), plan_terms(r["case"], cal)
        if peak is not None and p is not None:
            errs.append((r["case"]["name"], (p["total"] - peak) / peak))
    missed = [f"{name} {e:+.1%}" for name, e in errs if not -TOTAL_UNDER <= e <= TOTAL_OVER]
    target = f"every total within +{TOTAL_OVER:.0%} and -{TOTAL_UNDER:.0%} of its device peak"
    return f"target ({target}): " + ("met" if not missed else f"NOT met: {', '.join(missed)}")


def residuals(rows: list[dict[str, Any]], cal: Any) -> str:
    """What the allocator reserved beyond the tensors, against what its share could scale with.

    For the rows that measured reserved memory (device peak = reserved + context): reserved - allocated as a
    fraction of the step's fluctuating bytes (the planner's denominator) and of every term (the one before).
    Whichever stays more constant across rows describes the allocator better; where both scatter alike, the
    rows cannot tell them apart.
    """
    from gpu_check import plan_terms

    lines = [
        "| case | reserved - allocated GB | fluctuating GB | share of it | four terms GB | share of them |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    shares: dict[str, list[float]] = {"fluctuating": [], "four": []}
    for r in rows:
        res, p = r["result"], plan_terms(r["case"], cal)
        context = res.get("context_gb", cal.cuda.fixed_gb)
        if res.get("device_peak_gb") is None or p is None:
            continue
        unused = res["device_peak_gb"] - context - res["max_allocated_gb"]
        four = p["total"] - p["overhead"]
        shares["fluctuating"].append(unused / p["fluctuating"])
        shares["four"].append(unused / four)
        lines.append(
            f"| {r['case']['name']} | {unused:.2f} | {p['fluctuating']:.2f} | {unused / p['fluctuating']:.1%} "
            f"| {four:.2f} | {unused / four:.1%} |"
        )
    for name, values in shares.items():
        if values:
            spread = max(values) / min(values) if min(values) > 0 else float("inf")
            lines.append(f"\n{name}: share {min(values):.1%} to {max(values):.1%} ({spread:.1f}x apart)")
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
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--calibration", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--residuals", action="store_true", help="reserved - allocated against both denominators, then stop"
    )
    args = parser.parse_args(argv)

    rows, sources = [], []
    for path in args.results:
        results = json.loads(path.read_text())
        ok = [r for r in results["rows"] if r["result"].get("status") == "ok"]
        rows += ok
        meta = results.get("meta", {})
        gpu = (meta.get("gpu") or {}).get("name", "no GPU")
        sources.append(f"{path.name} ({meta.get('device', '?')}, {gpu}, {len(ok)} cases)")
    if not rows:
        print(f"{', '.join(map(str, args.results))}: no successful case to calibrate from", file=sys.stderr)
        return 2
    raw, before = load(args.calibration)
    if args.residuals:
        print(residuals(plannable(rows), before))
        return 0
    after, notes = fit(rows, before)
    print("\n".join(notes) + "\n")
    print(error_table(rows, before, after))
    print("\n" + verdict(rows, after))
    if args.dry_run:
        print("\n--dry-run: nothing written")
        return 0
    out = dict(raw)
    fitted = after.to_dict()
    for key, value in fitted.items():
        if key in ("cpu", "cuda"):
            out[key] = {**raw[key], **value}
        elif key in raw:
            out[key] = value
    stamp = f"{datetime.date.today().isoformat()}: scripts/calibrate.py {'; '.join(sources)}"
    kinds = {"cuda"} if any("max_allocated_gb" in r["result"] for r in rows) else set()
    kinds |= {"cpu"} if any("rss_peak_gb" in r["result"] for r in rows) else set()
    for kind in sorted(kinds):
        out[kind]["_calibrated"] = stamp
    write_atomic(args.calibration, out)
    print(f"\nwrote {args.calibration}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
