"""GRPO's held-out pass rate, greedy and under the rollout's sampling, for the model a run started from and
the model it trained (CPU).

    python scripts/bench_grpo_pass_rate.py RUN_DIR [RUN_DIR ...]            # 300 prompts, 4 samples each
    python scripts/bench_grpo_pass_rate.py RUN_DIR --prompts 64 --samples 2 --json out.json

Greedy: one answer per prompt, the evaluation's `max_new_tokens` (what mode=eval scores). Sampled: the usual
RL metric, the mean exact match over `--samples` answers per prompt drawn at the run's `grpo.temperature`
(top-p 1) with at most `grpo.max_completion_length` tokens, the training's own sampling; each sample a
seed of its own, the same seeds for both models. `base` is what training started from (under init_from,
that run's output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def exact_match(model: Any, tokenizer: Any, items: list[dict], cfg: Any) -> float:
    from finetune.evaluation import metrics
    from finetune.evaluation.generate import generate

    answers = generate(model, tokenizer, [it["messages"] for it in items], cfg)
    scores = metrics.score(
        metrics.resolve(["exact_match"]),
        [it["prompt"] for it in items],
        answers,
        [it["reference"] for it in items],
    )
    return float(scores["exact_match"])


def measure(run_dir: Path, prompts: int, samples: int) -> dict[str, Any]:
    import torch

    from finetune.data.stage import load_prepared
    from finetune.evaluation.stage import task_items
    from finetune.modeling.models import load_tokenizer, load_variant
    from finetune.rundir.state import load_config

    cfg = load_config(run_dir)
    items = task_items(load_prepared(run_dir)[1], prompts)
    tokenizer = load_tokenizer(cfg.model)
    greedy = replace(cfg.eval, greedy=True, progress=False)
    sampled = replace(
        cfg.eval,
        greedy=False,
        temperature=cfg.grpo.temperature,
        top_p=1.0,
        max_new_tokens=cfg.grpo.max_completion_length,
        progress=False,
    )
    row: dict[str, Any] = {"run": str(run_dir), "prompts": len(items), "samples": samples}
    for variant in ("base", "trained"):
        model = load_variant(cfg, run_dir, variant).to(torch.float32).eval()
        row[f"{variant}_greedy"] = exact_match(model, tokenizer, items, greedy)
        each = [exact_match(model, tokenizer, items, replace(sampled, seed=s)) for s in range(samples)]
        row[f"{variant}_sampled"] = statistics.mean(each)
        row[f"{variant}_sampled_each"] = each
        del model
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(run, args.prompts, args.samples) for run in args.runs]
    print(
        "| run | prompts | samples | base greedy | trained greedy | base sampled | trained sampled | gain sampled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {Path(r['run']).name} | {r['prompts']} | {r['samples']} | {r['base_greedy']:.3f} | "
            f"{r['trained_greedy']:.3f} | {r['base_sampled']:.3f} | {r['trained_sampled']:.3f} | "
            f"{r['trained_sampled'] - r['base_sampled']:+.3f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
