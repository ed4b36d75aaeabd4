"""The real pipeline on one GPU: `python -m finetune` per case, each run's measured peak against its plan.

    python scripts/gpu_pipeline.py OUT_DIR                  # on a GPU (scripts/gpu_check.sh runs it first)
    python scripts/gpu_pipeline.py OUT_DIR --cpu            # the same cases on tiny shapes, CPU, bf16
    python scripts/gpu_pipeline.py OUT_DIR --only lora --budget-s 200

Every case goes through the command line as a user's job does: the data stage, the plan, the
launcher, TRL's SFTTrainer with PEFT, the worker's evaluation of the base and the trained model in
bf16; the last case is the tiny recipe's whole pipeline (`python -m finetune hardware=h200`: data,
plan, train, evaluation, merge, export). No model hub: the model is built locally by the tiny
builder (random init) with the real Llama-3.1-8B layer shapes, 4 decoder layers and the real
128,256-token vocabulary (the tiny tokenizer uses the first ids of it), as DESIGN.md's GPU
reference table. Recorded per case, from the run's metrics.json and plan.json: CUDA
max_memory_allocated against the plan's total and terms, tokens/s and MFU, what ran (precision,
loss path, checkpointing, optimizer), held-out loss before and after. A case fails when the
command fails or the run is not what was asked (steps, bf16, loss path, checkpointing); memory
over the plan is recorded and flagged, not failed (scripts/calibrate.py refits from it). Cases
that would exceed the time budget are skipped and said so. Writes OUT_DIR/pipeline.md and
OUT_DIR/pipeline.json; exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9

# Llama-3.1-8B's layer shapes, 4 layers, its real vocabulary (DESIGN.md's GPU reference model).
SHAPE_8B = [
    "model.hidden_size=4096",
    "model.intermediate_size=14336",
    "model.num_heads=32",
    "model.num_kv_heads=8",
    "model.head_dim=128",
    "model.num_layers=4",
    "model.vocab_size=128256",
    "model.max_position_embeddings=8192",
]
# name, method, optimizer, seq_len, chunked loss, activation checkpointing, expected seconds on an H200
# (two process starts, the model's load, the worker's two evaluations, 4 steps): a case that needs more
# than the budget has left is skipped and the table says so.
CASES: list[dict[str, Any]] = [
    dict(name="lora-chunked", method="lora", seq_len=8192, chunked=True, ckpt=False, est_s=60),  # builds the model
    dict(name="tiny-recipe-pipeline", recipe=True, est_s=70),
    dict(name="lora-trl-loss", method="lora", seq_len=8192, chunked=False, ckpt=False, est_s=30),
    dict(name="lora-chunked-ckpt", method="lora", seq_len=8192, chunked=True, ckpt=True, est_s=30),
    dict(name="qlora-chunked-ckpt", method="qlora", seq_len=8192, chunked=True, ckpt=True, est_s=35),
    dict(name="qlora-trl-loss", method="qlora", seq_len=8192, chunked=False, ckpt=False, est_s=35),
    dict(name="full-8bit-chunked-ckpt", method="full", optimizer="adamw_8bit", seq_len=2048, chunked=True, ckpt=True, est_s=35),
    dict(name="full-8bit-trl-loss", method="full", optimizer="adamw_8bit", seq_len=2048, chunked=False, ckpt=False, est_s=35),
]  # fmt: skip
STEPS = 4


def case_args(case: dict[str, Any], run_dir: Path, cache: Path, cpu: bool) -> list[str]:
    """The command-line overrides of one case."""
    common = [f"run_dir={run_dir}", f"data.cache_dir={cache / 'data'}", "train.report_to=[]"]
    if case.get("recipe"):  # what a user with a GPU types to try the embedded default
        return [*common, "hardware=cpu" if cpu else "hardware=h200", *(["train.max_steps=60"] if cpu else [])]
    shape = [] if cpu else SHAPE_8B
    seq_len = 128 if cpu else case["seq_len"]
    return [
        *common,
        "model=tiny",
        *shape,
        "hardware=cpu" if cpu else "hardware=h200",
        f"method={case['method']}",
        "method.precision=bf16",
        "method.lora_dropout=0.0",
        f"method.optimizer={case.get('optimizer', 'adamw')}",
        f"train.seq_len={seq_len}",
        f"train.max_steps={STEPS}",
        "train.batch_size=1",
        "train.micro_batch_size=1",
        "train.grad_accum_steps=1",
        f"train.chunked_loss={str(case['chunked']).lower()}",
        f"train.activation_checkpointing={str(case['ckpt']).lower()}",
        "train.warmup_ratio=0.0",
        "train.logging_steps=1",
        "train.eval_steps=1000",
        "train.save_steps=1000",
        "eval.num_samples=32",  # the worker's base and trained generation: enough to check, quick
    ]


def finetune(args: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    with open(log, "a") as out:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "finetune", *args],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            out.write(f"\ngpu_pipeline: timed out after {timeout:.0f} s\n")
            return 124
    return proc.returncode


def model_flops_per_token(plan: dict[str, Any], seq_len: int, method: str, layers: int, q_dim: int) -> float:
    """6N (full) or 4N (frozen weights) plus causal attention; recomputation is not model FLOPs."""
    n = plan["params"]["total"]
    return (6.0 if method == "full" else 4.0) * n + 6.0 * layers * seq_len * q_dim


def check(case: dict[str, Any], metrics: dict[str, Any], cpu: bool = False) -> list[str]:
    """What ran differs from what was asked: each difference one line."""
    t = metrics.get("train", {})
    e = t.get("engine", {})
    problems = []
    # every case asks for bf16; the tiny recipe's precision is auto: bf16 on a GPU, fp32 on the CPU
    want, autocast = ("fp32", "no") if case.get("recipe") and cpu else ("bf16", "bf16")
    if t.get("precision") != want or e.get("mixed_precision") != autocast:
        problems.append(
            f"precision {t.get('precision')} / mixed precision {e.get('mixed_precision')}, not {want}"
        )
    if case.get("recipe"):
        return problems
    if t.get("steps") != STEPS:
        problems.append(f"{t.get('steps')} steps, not {STEPS}")
    if e.get("loss") != ("chunked" if case["chunked"] else "trl"):
        problems.append(f"loss path {e.get('loss')}")
    if e.get("activation_checkpointing") is not case["ckpt"]:
        problems.append(f"activation checkpointing {e.get('activation_checkpointing')}")
    if e.get("optimizer_kind") != case.get("optimizer", "adamw"):
        problems.append(f"optimizer {e.get('optimizer_kind')}")
    losses = [v.get("loss") for v in (metrics.get("eval") or {}).values() if isinstance(v, dict)]
    if not losses or not all(isinstance(x, float) and math.isfinite(x) for x in losses):
        problems.append(f"held-out losses {losses}")
    return problems


def run_case(case: dict[str, Any], out_dir: Path, cpu: bool, timeout: float) -> dict[str, Any]:
    run_dir = out_dir / "runs" / case["name"]
    log = out_dir / "logs" / f"{case['name']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: a finished one would not train again
    env = {**os.environ, "FINETUNE_CACHE": str(out_dir / "cache"), "PYTHONUNBUFFERED": "1"}
    args = case_args(case, run_dir, out_dir / "cache", cpu)
    start = time.perf_counter()
    modes = ["mode=all"] if case.get("recipe") else ["mode=data", "mode=train"]
    code = 0
    for mode in modes:
        code = finetune([mode, *args], log, max(1.0, timeout - (time.perf_counter() - start)), env)
        if code:
            break
    row: dict[str, Any] = {"name": case["name"], "seconds": round(time.perf_counter() - start, 1), "rc": code}
    metrics_path, plan_path = run_dir / "metrics.json", run_dir / "plan.json"
    if code or not metrics_path.is_file():
        tail = log.read_text()[-1500:] if log.is_file() else ""
        return {**row, "ok": False, "problems": [f"exit code {code}"], "log_tail": tail}
    metrics, plan = json.loads(metrics_path.read_text()), json.loads(plan_path.read_text())
    t = metrics["train"]
    problems = check(case, metrics, cpu)
    measured, planned = t.get("peak_memory_gb"), plan["gpu_memory_gb"]["total"]
    row.update(
        ok=not problems,
        problems=problems,
        peak_gb=measured,
        peak_source=t.get("peak_memory_source"),
        plan_gb=planned,
        plan_terms=plan["gpu_memory_gb"],
        error=None if not measured else round((planned - measured) / measured, 4),
        over_plan=bool(measured and measured > planned),
        tokens_per_second=t.get("tokens_per_second"),
        strategy=plan["strategy"],
        engine=t.get("engine"),
        eval={k: v.get("loss") for k, v in (metrics.get("eval") or {}).items() if isinstance(v, dict)},
    )
    if case.get("recipe"):
        final = run_dir / "eval" / "metrics.json"
        if final.is_file():
            scores = json.loads(final.read_text())
            row["eval"] = {
                k: {m: v.get(m) for m in ("loss", "exact_match")}
                for k, v in scores.items()
                if k in ("base", "trained", "merged")
            }
        merge = run_dir / "export" / "merge_check.json"
        row["merge_ok"] = json.loads(merge.read_text()).get("ok") if merge.is_file() else None
        if row["merge_ok"] is not True:
            row["ok"], row["problems"] = False, [*problems, "export: merge check missing or failed"]
    return row


def mfu(
    row: dict[str, Any], case: dict[str, Any], plan_path: Path, peak_tflops: Optional[float]
) -> Optional[float]:
    if not peak_tflops or not row.get("tokens_per_second") or case.get("recipe") or not plan_path.is_file():
        return None
    plan = json.loads(plan_path.read_text())
    flops = model_flops_per_token(plan, plan["seq_len"], case["method"], 4, 32 * 128)
    return round(row["tokens_per_second"] * flops / (peak_tflops * 1e12), 4)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# Pipeline check: {meta['device']}",
        "",
        f"{meta['date']}; {meta['versions']}; {STEPS} steps a case, micro-batch 1; peak = CUDA "
        "max_memory_allocated (metrics.json), about 0.8 GB of CUDA context comes on top.",
        "",
        "| case | ok | seconds | peak GB | plan GB | plan error | tokens/s | MFU | held-out loss base -> trained | problems |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ev = r.get("eval") or {}
        base, trained = (
            v.get("loss") if isinstance(v, dict) else v for v in (ev.get("base"), ev.get("trained"))
        )
        loss = "" if base is None else f"{base:.3f} -> {trained:.3f}"
        status = "yes" if r.get("ok") else ("SKIPPED" if r.get("skipped") else "NO")
        error = "" if r.get("error") is None else f"{r['error']:+.1%}"
        util = "" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        notes = "; ".join(r.get("problems", [])) or r.get("skipped", "")
        lines.append(
            f"| {r['name']} | {status} | {r.get('seconds', '')} | {r.get('peak_gb', '')} | {r.get('plan_gb', '')} "
            f"| {error} | {r.get('tokens_per_second', '')} | {util} | {loss} | {notes} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--cpu", action="store_true", help="tiny shapes on the CPU (checks the script itself)"
    )
    parser.add_argument("--budget-s", type=float, default=300.0, help="the whole run's time budget")
    parser.add_argument("--only", help="run only cases whose name contains this")
    args = parser.parse_args(argv)

    import datetime

    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("gpu_pipeline: no CUDA GPU here; --cpu runs the same cases on tiny shapes", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    meta = {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}",
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cases = [c for c in CASES if not args.only or args.only in c["name"]]
    deadline = time.perf_counter() + args.budget_s
    rows = []
    for case in cases:
        left = deadline - time.perf_counter()
        est = case["est_s"] * (3 if args.cpu else 1)
        if left < est:
            rows.append({"name": case["name"], "skipped": f"time budget: {left:.0f} s left, needs ~{est} s"})
            continue
        row = run_case(case, args.out_dir, args.cpu, timeout=left)
        row["mfu"] = mfu(
            row, case, args.out_dir / "runs" / case["name"] / "plan.json", 989.0 if cuda else None
        )
        rows.append(row)
        print(
            f"gpu_pipeline: {case['name']}: {'ok' if row['ok'] else 'FAILED ' + '; '.join(row['problems'])}",
            flush=True,
        )
    (args.out_dir / "pipeline.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out_dir / "pipeline.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0 if all(r.get("ok") or r.get("skipped") for r in rows) and any(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
