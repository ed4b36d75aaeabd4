"""Data preparation benchmark: our render+mask+tokenize+pack against TRL's tokenization and BFD packing.

    /tmp/venv/bin/python scripts/bench_data.py              # 50,000 conversations, seq_len 4096
    /tmp/venv/bin/python scripts/bench_data.py --n 2000     # quick run

Both pipelines get the same generated conversations (long-tailed, log-normal
reply lengths, 1-6 turns, some system prompts), the same byte-level BPE
tokenizer and the same Llama-3-shaped chat template, and produce
assistant-only labels:

- ours: `finetune.data.tokens.tokenize` (the fast tokenizer a batch of
  1,024 at a time, masks by prefix rendering: the stock template has no
  `{% generation %}` markers) + best-fit-decreasing packing into rows with
  restarting position ids;
- TRL: what `SFTTrainer` does with `assistant_only_loss=True, packing=True`:
  `apply_chat_template(..., return_assistant_tokens_mask=True)` per example
  (it needs the template with markers), the labels map, then
  `trl.data_utils.pack_dataset(strategy="bfd")`.

Samples longer than seq_len are dropped from both before packing, so the
packing efficiency compares like with like. Each pipeline runs in its own
process so its peak RSS is its own. Timings exclude data generation and the
tokenizer's training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _setup(n: int, seed: int, template: str):
    from finetune.data import synthetic

    convs = synthetic.conversations(n, seed=seed)
    tok = synthetic.build_tokenizer(synthetic.corpus_of(convs, 3000), template, vocab_size=8000)
    return convs, tok


def run_ours(n: int, seq_len: int, num_proc: int, seed: int, markers: bool) -> dict:
    import numpy as np

    from finetune.data import pack, synthetic
    from finetune.data import tokens as tokens_mod
    from finetune.data.render import IGNORE_INDEX, Renderer
    from finetune.data.tokens import tokenize

    convs, tok = _setup(n, seed, synthetic.LLAMA3_MARKERS if markers else synthetic.LLAMA3)
    renderer = Renderer(tok, "assistant")
    texts = [json.dumps(c, ensure_ascii=False) for c in convs]  # what the stage keeps of each sample
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-"))
    batches = [texts[i : i + tokens_mod.BATCH] for i in range(0, len(texts), tokens_mod.BATCH)]
    tokenize(
        [texts[:2]], 2, renderer, 1, scratch
    )  # warm-up: imports and template compilation, as for TRL below
    t0 = time.perf_counter()
    toks = tokenize(batches, len(texts), renderer, num_proc, scratch)
    # What the stage does next: BFD over the kept lengths, vectorised row gathering (labels from the mask bits).
    starts, lengths = toks.starts, toks.full_lengths
    keep = np.flatnonzero(lengths <= seq_len)
    kept_lengths = lengths[keep].tolist()
    bins = pack.order_bins(pack.best_fit_decreasing(kept_lengths, seq_len), kept_lengths, seed)
    groups = [[int(keep[i]) for i in b] for b in bins]
    rows = pack.gather_rows({"tokens": toks.ids, "labels": toks.labels}, starts, lengths, groups)
    elapsed = time.perf_counter() - t0
    tokens = int(sum(kept_lengths))
    trainable = int((rows["labels"].combine_chunks().values.to_numpy() != IGNORE_INDEX).sum())
    first_row = rows["seq_lengths"][0].as_py()
    return {
        "pipeline": "finetune" + (" (markers)" if markers else " (prefix masks)"),
        "seconds": elapsed,
        "tokens": tokens,
        "trainable_tokens": trainable,
        "samples": len(keep),
        "bins": len(bins),
        "efficiency": tokens / (len(bins) * seq_len),
        "longest_in_first_row": max(first_row) == max(kept_lengths),
    }


def run_trl(n: int, seq_len: int, num_proc: int, seed: int) -> dict:
    from datasets import Dataset
    from trl.data_utils import _tokenize, pack_dataset

    from finetune.data import synthetic

    convs, tok = _setup(n, seed, synthetic.LLAMA3_MARKERS)
    ds = Dataset.from_dict({"messages": convs})
    kw = {"num_proc": num_proc if num_proc > 1 else None}

    def tokenize_fn(example):  # SFTTrainer's tokenize_fn, conversational language-modeling branch
        out = _tokenize(tok, example["messages"], return_assistant_tokens_mask=True)
        return {k: out[k] for k in ("input_ids", "assistant_masks")}

    tokenize_fn({"messages": convs[0]})  # warm-up
    t0 = time.perf_counter()

    ds = ds.map(tokenize_fn, remove_columns=["messages"], **kw)

    def build_labels(example):  # SFTTrainer's build_labels
        return {
            "labels": [t if m else -100 for t, m in zip(example["input_ids"], example["assistant_masks"])]
        }

    ds = ds.map(build_labels, remove_columns=["assistant_masks"], **kw)
    ds = ds.filter(lambda x: len(x["input_ids"]) <= seq_len, **kw)
    packed = pack_dataset(ds, seq_len, strategy="bfd", map_kwargs=kw)
    # Materialise what the trainer would read (the packed columns).
    lens = [len(x) for x in packed["input_ids"]]
    elapsed = time.perf_counter() - t0
    tokens = sum(lens)
    trainable = sum(sum(x != -100 for x in lab) for lab in packed["labels"])
    return {
        "pipeline": "TRL 1.16 (apply_chat_template + pack_dataset bfd)",
        "seconds": elapsed,
        "tokens": tokens,
        "trainable_tokens": trainable,
        "samples": len(ds),
        "bins": len(packed),
        "efficiency": tokens / (len(packed) * seq_len),
        "longest_in_first_row": None,
    }


def _child(args) -> None:
    fn = {
        "ours": lambda: run_ours(args.n, args.seq_len, args.num_proc, args.seed, False),
        "ours-markers": lambda: run_ours(args.n, args.seq_len, args.num_proc, args.seed, True),
        "trl": lambda: run_trl(args.n, args.seq_len, args.num_proc, args.seed),
    }[args.only]
    result = fn()
    from finetune.rundir import machine

    result["peak_rss_mb"] = machine.peak_rss_bytes() / 2**20
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    print("RESULT " + json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=50_000, help="conversations (default 50,000)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--num-proc", type=int, default=1, help="datasets.map workers, both pipelines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markers", action="store_true", help="also run ours with the {% generation %} template")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--only", choices=("ours", "ours-markers", "trl"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:
        _child(args)
        return
    import datasets
    import tokenizers
    import transformers
    import trl

    results = []
    for which in ("ours", *(("ours-markers",) if args.markers else ()), "trl"):
        cmd = [
            sys.executable,
            __file__,
            "--only",
            which,
            "--n",
            str(args.n),
            "--seq-len",
            str(args.seq_len),
            "--num-proc",
            str(args.num_proc),
            "--seed",
            str(args.seed),
        ]
        env = {**os.environ, "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode or line is None:
            sys.exit(f"{which} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT ") :]))
    print(
        f"\n{args.n:,} conversations, seq_len {args.seq_len}, num_proc {args.num_proc}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}, datasets {datasets.__version__}, "
        f"tokenizers {tokenizers.__version__}\n"
    )
    print("| pipeline | samples | tokens | seconds | tokens/s | peak RSS MB | bins | efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['pipeline']} | {r['samples']:,} | {r['tokens']:,} | {r['seconds']:.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_rss_mb']:,.0f} | {r['bins']:,} | {r['efficiency']:.4f} |"
        )
    ours, theirs = results[0], results[-1]
    print(
        f"\nspeed-up vs TRL: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x; "
        f"same tokens: {ours['tokens'] == theirs['tokens']}, same trainable tokens: "
        f"{ours['trainable_tokens'] == theirs['trainable_tokens']}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results},
                indent=2,
                default=str,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
