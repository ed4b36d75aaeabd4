"""Peak memory and time of the causal-LM loss step on CPU: plain, ours (chunked), TRL's fused LM head.

Usage:
    python scripts/bench_loss.py                    # vocab 128,256, hidden 4,096, 4,096 tokens, fp32
    python scripts/bench_loss.py --quick            # vocab 32,000, hidden 1,024, 2,048 tokens (~1 min)
    python scripts/bench_loss.py --chunk-sizes 512 1024 2048 --repeats 3 --hidden 2048
    python scripts/bench_loss.py --dtype bfloat16 --tokens 8192 --paths chunked trl   # ours vs TRL's

The loss step is forward + backward from the final hidden states [1, tokens, h]
through the LM head to the scalar loss, for a frozen head (LoRA/QLoRA: only the
hidden states get a gradient) and a trainable head (full fine-tuning: the head
gets a [V, h] gradient too). The plain path is ``transformers``'
``ForCausalLMLoss(F.linear(hidden, W), labels)`` (what an nn.Linear head feeds it); the chunked path is
``finetune.modeling.chunked_loss.chunked_causal_lm_loss``; the trl path is SFTTrainer's loss in the TRL of
ARCHITECTURE.md's "Checked against" (its fused LM head: vocabulary tiles, log-probabilities recomputed in
the backward). On a CPU TRL folds its tiles with torch ops; on GPUs with a Triton kernel, so its CPU time
and memory are an upper bound.

Each measurement runs in a fresh subprocess: peak = the process's RSS
high-water mark (VmHWM, reset through /proc/self/clear_refs once the inputs are
allocated) after the step minus the RSS before it, so it counts everything the step allocates, including the
head's gradient in the trainable case ("head grad" column: the part no loss can
avoid). Cases are interleaved across repeats; the table shows medians. Prints
a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def load_chunked_loss():
    """Imports finetune/modeling/chunked_loss.py by path: the step's memory, not the package's CLI imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "chunked_loss", REPO_ROOT / "finetune/modeling/chunked_loss.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trl_fused_lm_head_loss(hidden_states, weight, labels):
    """TRL's SFTTrainer loss, as its fused LM head computes it (trl.trainer.utils.add_fused_lm_head):
    vocabulary tiles through `ChunkedLogProbFunction` on the labelled positions, with the entropy and
    top-1 outputs SFTTrainer asks for its metrics; the mean negative log-probability."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    hidden = hidden_states[:, :-1]
    targets = labels[:, 1:]
    mask = targets != -100
    log_probs = ChunkedLogProbFunction.apply(
        hidden[mask],
        weight,
        None,
        targets[mask],
        1.0,
        _CHUNKED_LOGPROB_CHUNK_SIZE,
        None,
        1.0,
        ("log_probs", "entropy", "is_top1"),
    )[0]
    return -log_probs.sum() / mask.sum().clamp(min=1)


def rss_kb() -> dict[str, int]:
    """Current (VmRSS) and peak (VmHWM) resident memory of this process, in kB (Linux)."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}


def reset_peak_rss() -> None:
    """Resets VmHWM to the current RSS, so temporaries freed before the step do not count."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def run_case(path: str, head: str, chunk_size: int, vocab: int, hidden: int, tokens: int, dtype: str) -> dict:
    """Runs one loss step in this (fresh) process; returns peak bytes and seconds."""
    import gc
    import time

    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    chunked_causal_lm_loss = load_chunked_loss().chunked_causal_lm_loss
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    weight = (
        torch.randn(vocab, hidden, dtype=torch_dtype).mul_(hidden**-0.5).requires_grad_(head == "trainable")
    )
    hidden_states = torch.randn(1, tokens, hidden, dtype=torch_dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    gc.collect()
    reset_peak_rss()
    baseline_kb = rss_kb()["VmRSS"]

    start = time.perf_counter()
    if path == "plain":
        loss = ForCausalLMLoss(torch.nn.functional.linear(hidden_states, weight), labels, vocab)
    elif path == "trl":
        loss = trl_fused_lm_head_loss(hidden_states, weight, labels)
    else:
        loss = chunked_causal_lm_loss(hidden_states, weight, labels, chunk_size=chunk_size)
    loss.backward()
    seconds = time.perf_counter() - start

    peak_kb = rss_kb()["VmHWM"]
    return {"peak_bytes": (peak_kb - baseline_kb) * 1024, "seconds": seconds, "loss": loss.item()}


def measure(args: argparse.Namespace, path: str, head: str, chunk_size: int) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        json.dumps([path, head, chunk_size, args.vocab, args.hidden, args.tokens, args.dtype]),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--hidden", type=int, default=4_096)
    parser.add_argument("--tokens", type=int, default=4_096)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--chunk-sizes", type=int, nargs="+", default=None, help="default: the module's default"
    )
    parser.add_argument(
        "--heads", nargs="+", choices=["frozen", "trainable"], default=["frozen", "trainable"]
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=["plain", "chunked", "trl"],
        default=["plain", "chunked", "trl"],
        help="plain: transformers' ForCausalLMLoss on full logits; chunked: ours; trl: TRL's fused LM head",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="vocab 32,000, hidden 1,024, 2,048 tokens")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_case(*json.loads(args.child))))
        return
    if args.quick:
        args.vocab, args.hidden, args.tokens = 32_000, 1_024, 2_048
    if args.chunk_sizes is None:
        args.chunk_sizes = [load_chunked_loss().DEFAULT_CHUNK_SIZE]

    cases = [(head, path, 0) for head in args.heads for path in args.paths if path != "chunked"]
    if "chunked" in args.paths:
        cases += [(head, "chunked", c) for head in args.heads for c in args.chunk_sizes]
    results: dict[tuple, list[dict]] = {case: [] for case in cases}
    for repeat in range(args.repeats):
        for case in cases:
            head, path, chunk_size = case
            results[case].append(measure(args, path, head, chunk_size))
            last = results[case][-1]
            print(
                f"# repeat {repeat + 1}/{args.repeats} {head:9} {path:7} chunk {chunk_size:5}: "
                f"peak {last['peak_bytes'] / GB:.2f} GB, {last['seconds']:.2f} s, loss {last['loss']:.6f}",
                file=sys.stderr,
                flush=True,
            )

    import torch
    import transformers
    import trl

    dtype_bytes = 4 if args.dtype == "float32" else 2
    print(
        f"vocab {args.vocab:,}, hidden {args.hidden:,}, {args.tokens:,} tokens, {args.dtype}; "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
        f"median of {args.repeats}, peak = RSS high-water mark of the step over its inputs; "
        "ratios against `chunked` (ours) with its first chunk size\n"
    )
    print("| head | path | chunk | head grad GB | peak GB | peak / ours | seconds | time / ours | loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for head in args.heads:
        head_grad = args.vocab * args.hidden * dtype_bytes if head == "trainable" else 0
        rows = [case for case in cases if case[0] == head]
        ours = next((c for c in rows if c[1] == "chunked"), rows[0])
        ours_peak = statistics.median(r["peak_bytes"] for r in results[ours])
        ours_s = statistics.median(r["seconds"] for r in results[ours])
        for case in rows:
            peak = statistics.median(r["peak_bytes"] for r in results[case])
            seconds = statistics.median(r["seconds"] for r in results[case])
            loss = statistics.median(r["loss"] for r in results[case])
            chunk = case[2] if case[1] == "chunked" else ("32768 x 4096" if case[1] == "trl" else "-")
            print(
                f"| {head} | {case[1]} | {chunk} | {head_grad / GB:.2f} | {peak / GB:.2f} | {peak / ours_peak:.2f}x "
                f"| {seconds:.1f} | {seconds / ours_s:.2f}x | {loss:.5f} |"
            )


if __name__ == "__main__":
    main()
