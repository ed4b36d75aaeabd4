"""The throughput levers on the CPU: steady tokens/s of the real trainer per `train.*` switch.

    python scripts/bench_levers.py OUT_DIR                          # tiny model, 3 interleaved repeats
    python scripts/bench_levers.py OUT_DIR --shape 8b2 --repeats 3  # 2 decoder layers of the 8B shape

Each case trains through `finetune.train.stage.run` (the worker's code: TRL's SFTTrainer, PEFT LoRA
r16, the chunked loss, the plan's strategy with micro-batch and accumulation fixed) in a fresh
process, on the bundled data's packed rows, with `train.profile=true`: the figure is the profile's
steady tokens/s (the median rate of the steps after the first, without the profiled last one; the
first step carries torch.compile's compilation, a later new row width a recompilation) and the
split of a step. Cases run interleaved
(case 1..n, then again), so the shared machine's noise hits them alike; the table gives medians.
Each case's first loss is recorded too: a lever must not change what is computed.

Shapes: `tiny` (configs/model/tiny.yaml, seq_len 128, micro-batch 4: fp32 and bf16 cases) and
`8b2` (Llama-3.1-8B's layer dimensions, 2 layers, vocabulary 8,192, seq_len 256, micro-batch 1:
bf16 cases only, as a GPU runs them; fp32 at that size is too slow here). Writes OUT_DIR/levers.md
and OUT_DIR/levers.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(model=[], seq_len=128, micro_batch=4, n_train=160),
    "8b2": dict(
        model=[
            "model.hidden_size=4096",
            "model.intermediate_size=14336",
            "model.num_heads=32",
            "model.num_kv_heads=8",
            "model.head_dim=128",
            "model.num_layers=2",
            "model.vocab_size=8192",
        ],
        seq_len=256,
        micro_batch=1,
        n_train=40,
    ),
}
# case name: overrides on top of the shape's (LoRA, dropout 0).
CASES: dict[str, list[str]] = {
    "fp32 baseline (sdpa)": [],
    "fp32 eager attention": ["train.attention=eager"],
    "fp32 fused AdamW": ["train.fused_optimizer=true"],
    "fp32 compiled layers": ["train.compile=true"],
    "bf16 baseline (fp32 adapters)": ["method.precision=bf16"],
    "bf16 adapters": ["method.precision=bf16", "method.adapter_dtype=bf16"],
    "bf16 eager attention": ["method.precision=bf16", "train.attention=eager"],
    "bf16 fused AdamW": ["method.precision=bf16", "train.fused_optimizer=true"],
    "bf16 compiled layers": ["method.precision=bf16", "train.compile=true"],
}


def cases_for(shape: str) -> dict[str, list[str]]:
    return {k: v for k, v in CASES.items() if shape == "tiny" or k.startswith("bf16")}


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One case in this (fresh) process: prepare data (cached), train, return the profile."""
    import os
    from dataclasses import replace

    os.environ["FINETUNE_CACHE"] = spec["cache"]
    from finetune.core.composition import compose, load_profiles
    from finetune.data import stage as data_stage
    from finetune.launch.engines import write_engine_files
    from finetune.pipeline.stages import resolve
    from finetune.planner import make_plan
    from finetune.train import stage

    shape = SHAPES[spec["shape"]]
    cfg = resolve(
        compose(
            [
                f"run_dir={spec['run_dir']}",
                f"data.cache_dir={spec['cache']}/data",
                "method=lora",
                "method.lora_dropout=0.0",
                *shape["model"],
                f"train.seq_len={shape['seq_len']}",
                f"train.max_steps={spec['steps']}",
                "train.logging_steps=1",
                "train.eval_steps=100000",
                "train.save_steps=100000",
                "train.report_to=[]",
                "train.warmup_ratio=0.0",
                "train.profile=true",
                *spec["overrides"],
            ]
        )
    )
    data_dir = Path(spec["cache"]) / f"data-{spec['shape']}"
    if not (data_dir / "data_stats.json").is_file():
        data_stage.run(cfg, data_dir)
    train, evals = data_stage.load_prepared(data_dir)
    plan = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, load_profiles())
    strategy = replace(
        plan.strategy, micro_batch_size=shape["micro_batch"], grad_accum_steps=1, chunked_loss=True
    )
    plan = replace(plan, strategy=strategy)
    write_engine_files(cfg, plan, Path(spec["run_dir"]))  # what the launcher writes for the ranks
    metrics = stage.run(
        cfg,
        Path(spec["run_dir"]),
        plan,
        datasets=(train.select(range(shape["n_train"])), evals.select(range(4))),
    )
    t = metrics["train"]
    first_loss = next((e["loss"] for e in _log_history(Path(spec["run_dir"])) if "loss" in e), None)
    return {
        "tokens_per_second": t["profile"]["tokens_per_second"],
        "share": t["profile"]["share"],
        "step_s": t["profile"]["median_s"]["step_s"],
        "first_loss": first_loss,
        "peak_rss_gb": t["peak_memory_gb"],
        "engine": {
            k: t["engine"][k] for k in ("attention", "compiled_layers", "fused_optimizer", "parameter_dtypes")
        },
    }


def _log_history(run_dir: Path) -> list[dict[str, Any]]:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(run_dir / "checkpoints"))
    return list(json.loads((Path(last) / "trainer_state.json").read_text())["log_history"])


def spawn(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "unused", "--case-json", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def markdown(meta: dict[str, Any], table: list[dict[str, Any]]) -> str:
    lines = [
        f"{meta['shape']}: {meta['machine']}; {meta['versions']}; {meta['repeats']} interleaved repeats of "
        f"{meta['steps']} steps, medians; steady tokens/s (median step rate after the first step, without the profiled last)",
        "",
        "| case | tokens/s | vs baseline | step s | split % data/fwd/loss/bwd/opt | first loss |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for row in table:
        share = row.get("share") or {}
        split = " / ".join(
            f"{share.get(k, 0) * 100:.0f}" for k in ("data", "forward", "loss", "backward", "optimizer")
        )
        ratio = f"{row['ratio']:.2f}x" if row.get("ratio") else ""
        lines.append(
            f"| {row['case']} | {row.get('tokens_per_second', 'error')} | {ratio} | {row.get('step_s', '')} "
            f"| {split} | {row.get('first_loss', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--case-json", help=argparse.SUPPRESS)  # internal: run one case, print its result
    args = parser.parse_args(argv)
    if args.case_json:
        print("RESULT " + json.dumps(run_one(json.loads(args.case_json))), flush=True)
        return 0

    import importlib.metadata as md

    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cases = cases_for(args.shape)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for repeat in range(args.repeats):
        for i, (name, overrides) in enumerate(cases.items()):
            spec = dict(
                shape=args.shape,
                overrides=overrides,
                steps=args.steps,
                cache=str(out / "cache"),
                run_dir=str(out / "runs" / f"{args.shape}-{i}-{repeat}"),
            )
            res = spawn(spec)
            results[name].append(res)
            print(f"bench_levers: {name} #{repeat + 1}: {json.dumps(res)[:200]}", file=sys.stderr, flush=True)
    table = []
    for name, runs in results.items():
        ok = [r for r in runs if "tokens_per_second" in r]
        if not ok:
            table.append({"case": name, "error": runs[-1].get("error")})
            continue
        row = {
            "case": name,
            "tokens_per_second": round(statistics.median(r["tokens_per_second"] for r in ok), 1),
            "step_s": round(statistics.median(r["step_s"] for r in ok), 4),
            "share": {k: statistics.median(r["share"][k] for r in ok) for k in ok[0]["share"]},
            "first_loss": round(ok[0]["first_loss"], 5),
            "runs": ok,
        }
        table.append(row)
    for row in table:
        base = next(r for r in table if r["case"].startswith(row["case"][:4]) and "baseline" in r["case"])
        if row.get("tokens_per_second") and base.get("tokens_per_second"):
            row["ratio"] = row["tokens_per_second"] / base["tokens_per_second"]
    meta = dict(
        shape=args.shape,
        date=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()}, {__import__('os').cpu_count()} CPU cores",
        versions=", ".join(f"{p} {md.version(p)}" for p in ("torch", "transformers", "trl", "peft")),
        repeats=args.repeats,
        steps=args.steps,
    )
    (out / "levers.json").write_text(json.dumps({"meta": meta, "table": table}, indent=1) + "\n")
    text = markdown(meta, table)
    (out / "levers.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
