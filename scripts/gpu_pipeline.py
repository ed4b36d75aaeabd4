"""The real pipeline on one GPU: `python -m finetune` per case, each run's measured peak against its plan.

    python scripts/gpu_pipeline.py OUT_DIR                  # on a GPU (scripts/gpu_check.sh runs it first)
    python scripts/gpu_pipeline.py OUT_DIR --cpu            # the same cases on tiny shapes, CPU, bf16
    python scripts/gpu_pipeline.py OUT_DIR --only lora --budget-s 200
    python scripts/gpu_pipeline.py OUT_DIR --suite throughput   # the levers' tokens/s and step split

Every case goes through the command line as a user's job does: the data stage, the plan, the
launcher, TRL's SFTTrainer with PEFT, the eval stage's scores of the base and the trained model in
bf16; the last case is the tiny recipe's whole pipeline (`python -m finetune hardware=h200`: data,
plan, train, evaluation, merge, export). No model hub: the model is built locally by the tiny
builder (random init) with the real Llama-3.1-8B layer shapes, 4 decoder layers and the real
128,256-token vocabulary (the tiny tokenizer uses the first ids of it), as the GPU reference table
of finetune/planner/MEMORY_MODEL.md. Recorded per case, from the run's metrics.json and plan.json: CUDA
max_memory_allocated against the plan's total and terms, tokens/s and MFU, what ran (precision,
loss path, checkpointing, optimizer), held-out loss before and after. A case fails when the
command fails or the run is not what was asked (steps, bf16, loss path, checkpointing); memory
over the plan is recorded and flagged, not failed (scripts/calibrate.py refits from it). Cases
that would exceed the time budget are skipped and said so. Writes OUT_DIR/pipeline.md and
OUT_DIR/pipeline.json; exits 1 when a case failed.

Two suites (`--suite memory`, the default, is what scripts/gpu_check.sh runs in its 8 minutes;
`--suite throughput` is the second check; `--suite all` runs both, throughput first):
- throughput, most needed first: 8B LoRA at 8,192 tokens on generated data with several
  samples a row (about 30, as real SFT data packs) under SDPA and FlexAttention, one sequence a
  row, micro-batch 2 and 4, QLoRA and full fine-tuning on packed rows, then compiled decoder
  layers, flash-attn and Liger (these two only where installed);
- memory: the bundled data (about 340 short samples a row at 8,192), the loss path and
  checkpointing on and off per method, and the tiny recipe's whole pipeline.
Every case runs with `train.profile=true`: each step split into data, forward, loss, backward and
optimizer (medians of the steps after the first, the GPU synchronized at each boundary), the steady
tokens/s and MFU from them, and the attention kernels the profiled step ran (profile_ops.txt in
the run directory lists its operators). MFU counts 6N (full) or 4N (frozen weights) a token with
N without the input embedding (a lookup, no FLOPs), plus causal attention over each token's own
sample (packed rows: the token-weighted mean sample length, not the row length).
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

# Llama-3.1-8B's layer shapes, 4 layers, its real vocabulary (MEMORY_MODEL.md's GPU reference model).
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
# (two process starts, the model's load, the evaluations, the steps; a case that needs more than
# the budget has left is skipped and the table says so);
# throughput cases also: data (packed | single: generated, see write_data), attention, micro-batch (mb),
# steps, compile, liger, gpu_only (skipped with --cpu), needs (a module that must be importable, else skipped).
THROUGHPUT_CASES: list[dict[str, Any]] = [
    dict(name="lora-packed-sdpa", method="lora", seq_len=8192, chunked=True, ckpt=False, data="packed", est_s=40),
    dict(name="lora-packed-flex", method="lora", seq_len=8192, chunked=True, ckpt=False, data="packed", attention="flex", gpu_only=True, est_s=60),
    dict(name="lora-single-sdpa", method="lora", seq_len=8192, chunked=True, ckpt=False, data="single", est_s=40),
    dict(name="lora-packed-mb2", method="lora", seq_len=8192, chunked=True, ckpt=False, data="packed", mb=2, est_s=40),
    dict(name="lora-packed-mb4", method="lora", seq_len=8192, chunked=True, ckpt=False, data="packed", mb=4, est_s=45),
    dict(name="qlora-packed-ckpt", method="qlora", seq_len=8192, chunked=True, ckpt=True, data="packed", est_s=45),
    dict(name="full-8bit-packed-ckpt", method="full", optimizer="adamw_8bit", seq_len=2048, chunked=True, ckpt=True, data="packed", est_s=50),
    dict(name="lora-packed-compile", method="lora", seq_len=8192, chunked=True, ckpt=False, data="packed", compile=True, est_s=90),
    dict(name="lora-packed-flash", method="lora", seq_len=8192, chunked=True, ckpt=False, data="packed", attention="flash", gpu_only=True, needs="flash_attn", est_s=40),
    dict(name="lora-packed-liger", method="lora", seq_len=8192, chunked=True, ckpt=False, data="packed", liger=True, gpu_only=True, needs="liger_kernel", est_s=40),
]  # fmt: skip
for _case in THROUGHPUT_CASES:
    _case.setdefault("steps", 8)  # the first is warm-up, the last runs under torch.profiler
    _case["suite"] = "throughput"
MEMORY_CASES: list[dict[str, Any]] = [
    dict(name="lora-chunked", method="lora", seq_len=8192, chunked=True, ckpt=False, est_s=60),  # builds the model
    dict(name="tiny-recipe-pipeline", recipe=True, est_s=70),
    dict(name="lora-trl-loss", method="lora", seq_len=8192, chunked=False, ckpt=False, est_s=30),
    dict(name="lora-chunked-ckpt", method="lora", seq_len=8192, chunked=True, ckpt=True, est_s=30),
    dict(name="qlora-chunked-ckpt", method="qlora", seq_len=8192, chunked=True, ckpt=True, est_s=35),
    dict(name="qlora-trl-loss", method="qlora", seq_len=8192, chunked=False, ckpt=False, est_s=35),
    dict(name="full-8bit-chunked-ckpt", method="full", optimizer="adamw_8bit", seq_len=2048, chunked=True, ckpt=True, est_s=35),
    dict(name="full-8bit-trl-loss", method="full", optimizer="adamw_8bit", seq_len=2048, chunked=False, ckpt=False, est_s=35),
]  # fmt: skip
for _case in MEMORY_CASES:
    _case["suite"] = "memory"
CASES = THROUGHPUT_CASES + MEMORY_CASES
STEPS = 4
# Generated data (write_data): samples a row when packed, and the share of a row one sample fills alone.
SAMPLES_PER_ROW = {"gpu": 30, "cpu": 4}
SINGLE_FILL = 0.85


def case_args(
    case: dict[str, Any], run_dir: Path, cache: Path, cpu: bool, data_file: Optional[Path] = None
) -> list[str]:
    """The command-line overrides of one case (`data_file`: its generated data, for `data` cases)."""
    common = [
        f"run_dir={run_dir}",
        f"data.cache_dir={cache / 'data'}",
        "train.report_to=[]",
        "train.profile=true",
    ]
    if case.get("recipe"):  # what a user with a GPU types to try the embedded default
        return [*common, "hardware=cpu" if cpu else "hardware=h200", *(["train.max_steps=60"] if cpu else [])]
    shape = [] if cpu else SHAPE_8B
    seq_len = 128 if cpu else case["seq_len"]
    mb = case.get("mb", 1)
    data = []
    if case.get("data"):
        data = [
            "data=jsonl",
            f"data.path={data_file}",
            "data.train_on=all",  # every token labelled: packed and single rows do the same work a token
            "data.eval_fraction=0.05",
            "data.num_proc=1",
            f"data.packing={str(case['data'] == 'packed').lower()}",
        ]
    return [
        *common,
        *data,
        "model=tiny",
        *shape,
        "hardware=cpu" if cpu else "hardware=h200",
        f"method={case['method']}",
        "method.precision=bf16",
        "method.lora_dropout=0.0",
        f"method.optimizer={case.get('optimizer', 'adamw')}",
        f"train.seq_len={seq_len}",
        f"train.max_steps={case.get('steps', STEPS)}",
        f"train.batch_size={mb}",
        f"train.micro_batch_size={mb}",
        "train.grad_accum_steps=1",
        f"train.chunked_loss={str(case['chunked']).lower()}",
        f"train.activation_checkpointing={str(case['ckpt']).lower()}",
        f"train.attention={case.get('attention', 'sdpa')}",
        f"train.compile={str(case.get('compile', False)).lower()}",
        f"train.liger={str(case.get('liger', False)).lower()}",
        "train.warmup_ratio=0.0",
        "train.logging_steps=1",
        "train.eval_steps=1000",
        "train.save_steps=1000",
        # the eval stage's base and trained generation: enough to check, quick
        "eval.num_samples=32",
        "eval.regression=false",
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


def model_flops_per_token(
    plan: dict[str, Any], context: float, method: str, layers: int, q_dim: int, embedding: int = 0
) -> float:
    """6N (full) or 4N (frozen weights) plus causal attention; recomputation is not model FLOPs.

    `context`: the token-weighted mean length of the sequences a token attends within (the row length
    for one sequence a row; much less for packed rows); `embedding`: parameters of the input embedding,
    a lookup that does no matmul, left out of N."""
    n = plan["params"]["total"] - embedding
    return (6.0 if method == "full" else 4.0) * n + 6.0 * layers * context * q_dim


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
    steps = case.get("steps", STEPS)
    if t.get("steps") != steps:
        problems.append(f"{t.get('steps')} steps, not {steps}")
    attention = {"sdpa": "sdpa", "flex": "flex_attention", "flash": "flash_attention_2"}[
        case.get("attention", "sdpa")
    ]
    if e.get("attention") != attention:
        problems.append(f"attention {e.get('attention')}, not {attention}")
    if e.get("micro_batch_size") != case.get("mb", 1):
        problems.append(f"micro-batch {e.get('micro_batch_size')}")
    if e.get("compiled_layers") is not bool(case.get("compile")):
        problems.append(f"compiled layers {e.get('compiled_layers')}")
    if e.get("liger") is not bool(case.get("liger")):
        problems.append(f"liger {e.get('liger')}")
    if not (t.get("profile") or {}).get("tokens_per_second"):
        problems.append("no step profile (train.profile)")
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


def write_data(path: Path, kind: str, seq_len: int, per_row: int, vocab_size: int, seed: int = 0) -> Path:
    """Generated conversations (one user turn, one assistant turn) sized in the tokens of the tiny
    tokenizer the runs use (its vocabulary: `vocab_size`).

    packed: about `per_row` samples a row (lengths spread 0.5x to 1.5x around seq_len / per_row), as real
    SFT data packs; single: each sample fills `SINGLE_FILL` of a row, one a row (data.packing=false).
    Assistant replies stay short, so the evaluation generates little.
    """
    import random

    from finetune.core.config import ModelConfig
    from finetune.modeling import tiny

    if path.is_file():
        return path
    tok = tiny.load_tokenizer(ModelConfig(vocab_size=vocab_size))
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "an", "el", "or", "us", "ta", "po", "qe"]

    def text(n_words: int) -> str:
        return " ".join(
            "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(n_words)
        )

    reply_words = 2 if seq_len <= 1024 else 8

    def tokens(conversation: list[dict[str, str]]) -> int:
        rendered = tok.apply_chat_template(conversation, tokenize=False)
        return len(tok(rendered, add_special_tokens=False)["input_ids"])

    # tokens(sample) = overhead (template) + tokens_per_word x words
    overhead = tokens([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}])
    probe = [{"role": "user", "content": text(2000)}, {"role": "assistant", "content": text(10)}]
    tokens_per_word = (tokens(probe) - overhead) / 2010
    if kind == "packed":
        mean = 0.95 * seq_len / per_row  # packing leaves a little of each row empty
        sizes = [rng.uniform(0.5, 1.5) * mean for _ in range(per_row * (12 if seq_len > 1024 else 40))]
    else:
        sizes = [SINGLE_FILL * seq_len] * 48
    lines = []
    for size in sizes:
        words = max(1, round((size - overhead) / tokens_per_word) - reply_words)
        conversation = [
            {"role": "user", "content": text(words)},
            {"role": "assistant", "content": text(reply_words)},
        ]
        lines.append(json.dumps({"messages": conversation}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def data_shape(run_dir: Path) -> dict[str, Any]:
    """Samples a row and the token-weighted mean sample length of the prepared training rows."""
    from finetune.data.stage import load_prepared

    train, _ = load_prepared(run_dir)
    lengths = [list(r) for r in train["seq_lengths"]]
    flat = [n for row in lengths for n in row]
    return {
        "rows": len(lengths),
        "samples_per_row": round(len(flat) / max(1, len(lengths)), 2),
        "context": sum(n * n for n in flat) / max(1, sum(flat)),
    }


def run_case(case: dict[str, Any], out_dir: Path, cpu: bool, timeout: float) -> dict[str, Any]:
    run_dir = out_dir / "runs" / case["name"]
    log = out_dir / "logs" / f"{case['name']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: a finished one would not train again
    env = {**os.environ, "FINETUNE_CACHE": str(out_dir / "cache"), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    data_file = None
    if case.get("data"):
        # the tiny tokenizer is built where the runs will find it
        os.environ["FINETUNE_CACHE"] = env["FINETUNE_CACHE"]
        seq_len = 128 if cpu else case["seq_len"]
        vocab = 512 if cpu else 128256  # configs/model/tiny.yaml's, or SHAPE_8B's
        name = f"{case['data']}-{seq_len}-v{vocab}.jsonl"
        per_row = SAMPLES_PER_ROW["cpu" if cpu else "gpu"]
        data_file = write_data(out_dir / "data" / name, case["data"], seq_len, per_row, vocab)
    args = case_args(case, run_dir, out_dir / "cache", cpu, data_file)
    modes = ["mode=all"] if case.get("recipe") else ["mode=data", "mode=train", "mode=eval"]
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
    profile = t.get("profile") or {}
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
        # the steps after the first, without the profiled one (finetune/train/profiling.py)
        steady_tokens_per_second=profile.get("tokens_per_second"),
        split=profile.get("share"),
        step_s=(profile.get("median_s") or {}).get("step_s"),
        attention_ops=[op["name"] for op in profile.get("attention_ops", [])][:4],
        strategy=plan["strategy"],
        engine=t.get("engine"),
        eval={k: v.get("loss") for k, v in (metrics.get("eval") or {}).items() if isinstance(v, dict)},
    )
    if not case.get("recipe"):
        row["data"] = data_shape(run_dir)
        want = case.get("data")
        per_row = row["data"]["samples_per_row"]
        if want == "packed" and per_row < SAMPLES_PER_ROW["cpu" if cpu else "gpu"] / 2:
            row["problems"].append(f"{per_row} samples a row: not several")
        if want == "single" and per_row != 1:
            row["problems"].append(f"{per_row} samples a row, not one")
        row["ok"] = not row["problems"]
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
    """Model FLOPs utilisation at the steady tokens/s (falls back to the whole loop's)."""
    rate = row.get("steady_tokens_per_second") or row.get("tokens_per_second")
    if not peak_tflops or not rate or case.get("recipe") or not plan_path.is_file():
        return None
    plan = json.loads(plan_path.read_text())
    context = (row.get("data") or {}).get("context") or plan["seq_len"]
    embedding = 128256 * 4096  # SHAPE_8B's input embedding (untied)
    flops = model_flops_per_token(plan, context, case["method"], 4, 32 * 128, embedding)
    return round(rate * flops / (peak_tflops * 1e12), 4)


def _split(row: dict[str, Any]) -> str:
    share = row.get("split") or {}
    if not share:
        return ""
    return " / ".join(
        f"{share.get(k, 0) * 100:.0f}" for k in ("data", "forward", "loss", "backward", "optimizer")
    )


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# Pipeline check: {meta['device']}",
        "",
        f"{meta['date']}; {meta['versions']}; micro-batch 1 unless the case says; peak = CUDA "
        "max_memory_allocated (metrics.json), about 0.8 GB of CUDA context comes on top. tokens/s: the "
        "whole loop (metrics.json) and steady (the median step's rate after the first, without the profiled one); "
        "MFU at the steady rate; split: % of a step in data / forward / loss / backward / optimizer.",
        "",
        "| case | ok | seconds | samples a row | peak GB | plan GB | plan error | tokens/s | steady tokens/s "
        "| MFU | split % | attention ops | held-out loss base -> trained | problems |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
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
        per_row = (r.get("data") or {}).get("samples_per_row", "")
        ops = ", ".join(r.get("attention_ops") or [])
        lines.append(
            f"| {r['name']} | {status} | {r.get('seconds', '')} | {per_row} | {r.get('peak_gb', '')} "
            f"| {r.get('plan_gb', '')} | {error} | {r.get('tokens_per_second', '')} "
            f"| {r.get('steady_tokens_per_second') or ''} | {util} | {_split(r)} | {ops} | {loss} | {notes} |"
        )
    return "\n".join(lines) + "\n"


def select(cases: list[dict[str, Any]], suite: str, only: Optional[list[str]]) -> list[dict[str, Any]]:
    return [
        c for c in cases if suite in ("all", c["suite"]) and (not only or any(o in c["name"] for o in only))
    ]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--cpu", action="store_true", help="tiny shapes on the CPU (checks the script itself)"
    )
    parser.add_argument("--budget-s", type=float, default=300.0, help="the whole run's time budget")
    parser.add_argument(
        "--only", action="append", help="run only cases whose name contains this (repeatable: any of them)"
    )
    parser.add_argument("--suite", choices=("all", "throughput", "memory"), default="memory")
    args = parser.parse_args(argv)

    import datetime
    import importlib.util

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
    cases = select(CASES, args.suite, args.only)
    deadline = time.perf_counter() + args.budget_s
    rows = []
    for case in cases:
        left = deadline - time.perf_counter()
        est = case["est_s"] * (3 if args.cpu else 1)
        if case.get("gpu_only") and args.cpu:
            rows.append(
                {"name": case["name"], "skipped": "needs CUDA (training with it is refused on the CPU)"}
            )
            continue
        if case.get("needs") and importlib.util.find_spec(case["needs"]) is None:
            rows.append({"name": case["name"], "skipped": f"{case['needs']} is not installed"})
            continue
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
