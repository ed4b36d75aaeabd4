"""The sequence split on CPU ranks: step time of Ulysses over two gloo ranks against one rank on the whole
sequence, and each rank's activation bytes against the planner's figure.

    python scripts/bench_sequence_parallel.py                 # seq 512 and 2048, fp32 and bf16, 5 timed steps
    python scripts/bench_sequence_parallel.py --seq-lens 4096 --steps 3

Each case starts scripts/sequence_parallel_worker.py under torchrun (one thread a rank) with one rank and
with two, and prints a table: the median forward+backward seconds of each (and their ratio: the split's
overhead on the CPU, where two ranks share two cores and the all-to-all goes through gloo), the bytes the
second decoder layer saved on one rank of each, and the planner's per-rank figure for it (its error).
The CPU says nothing about a GPU's speed-up: there the split exists to fit, and NVLink carries the exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.core.composition import compose  # noqa: E402
from finetune.core.config import ModelConfig  # noqa: E402
from finetune.planner import Strategy, make_job, runtime  # noqa: E402
from finetune.planner.activations import LayerRun, LayerShape, layer_bytes_per_token  # noqa: E402
from finetune.planner.job import rank_tokens  # noqa: E402
from finetune.planner.step import split_saved_per_token  # noqa: E402


def run(ranks: int, dtype: str, seq_len: int, steps: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(REPO / "scripts" / "sequence_parallel_worker.py"), "--out", str(out), "--dtype", dtype,
        "--seq-len", str(seq_len), "--steps", str(steps),
    ]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def planned(result: dict, degree: int) -> float:
    """The planner's bytes for the worker's second decoder layer on one rank."""
    sh = result["shape"]
    model = ModelConfig(
        name="sp-worker", hidden_size=sh["hidden_size"], num_layers=sh["num_hidden_layers"],
        num_heads=sh["num_attention_heads"], num_kv_heads=sh["num_key_value_heads"], head_dim=sh["head_dim"],
        intermediate_size=sh["intermediate_size"], vocab_size=sh["vocab_size"],
        max_position_embeddings=sh["max_position_embeddings"],
    )  # fmt: skip
    cfg = compose(["method=full", f"train.seq_len={result['seq_len']}", "hardware.gpus_per_node=2"])
    job = make_job(model, cfg.method, cfg.hardware, cfg.train, result["seq_len"])
    s = Strategy(sharding="zero3", micro_batch_size=1, sequence_parallel=degree)
    dtype_bytes = 4 if result["dtype"] == "fp32" else 2
    rt = replace(runtime(job, s), compute=dtype_bytes)
    per_token = layer_bytes_per_token(LayerShape.of(model), LayerRun("full", dtype_bytes=dtype_bytes))
    return (per_token + split_saved_per_token(job, s, rt)) * rank_tokens(job, s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="512,2048")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(
        "| seq | dtype | 1 rank s/step | 2 ranks s/step | ratio | layer bytes, 1 rank | per rank of 2 | "
        "planned per rank of 2 | error |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seq in (int(v) for v in args.seq_lens.split(",")):
            for dtype in args.dtypes.split(","):
                one = run(1, dtype, seq, args.steps, Path(tmp) / "one.json")
                two = run(2, dtype, seq, args.steps, Path(tmp) / "two.json")
                share = two["layer_saved_bytes"][0]
                plan = planned(two, 2)
                print(
                    f"| {seq} | {dtype} | {one['step_seconds']:.4f} | {two['step_seconds']:.4f} | "
                    f"{two['step_seconds'] / one['step_seconds']:.2f} | {one['layer_saved_bytes'][0]:,} | "
                    f"{share:,} | {plan:,.0f} | {100 * (plan - share) / share:+.1f}% |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
