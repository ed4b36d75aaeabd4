"""GRPO's held-out pass rate, greedy and under the rollout's sampling, for the model a run started from and
the model it trained (CPU).

    python scripts/bench_grpo_pass_rate.py RUN_DIR [RUN_DIR ...]            # 300 prompts, 4 samples each
    python scripts/bench_grpo_pass_rate.py RUN_DIR --prompts 64 --samples 2 --json out.json

The pass rate is the share of answers earning every reward the run trained on its full value (the evaluation's
`pass_rate`, `finetune/core/rewards.py`); exact match is printed beside it. Greedy: one answer per prompt,
the evaluation's `max_new_tokens` (what mode=eval scores). Sampled: the usual RL metric, the mean pass rate
over `--samples` answers per prompt drawn at the run's `objective.temperature`
(top-p 1) with at most `objective.max_completion_length` tokens, the training's own sampling; each sample a
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


def score(model: Any, tokenizer: Any, items: list[dict], cfg: Any, run_rewards: Any) -> dict[str, Any]:
    """Exact match and the pass rate under the run's rewards, of one answer per prompt; the pass rate per
    reference answer (a model that answers one word whatever the input passes on one class only)."""
    from finetune.core import metrics, rewards
    from finetune.evaluation.generate import generate

    answers = generate(model, tokenizer, [it["messages"] for it in items], cfg)
    prompts, references = [it["prompt"] for it in items], [it["reference"] for it in items]
    exact = metrics.score(metrics.resolve(["exact_match"]), prompts, answers, references)
    _, each = rewards.total(run_rewards, prompts, answers, references)
    passed = [all(each[r.name][i] >= 1.0 for r in run_rewards) for i in range(len(answers))]
    by_reference: dict[str, list[bool]] = {}
    for reference, hit in zip(references, passed):
        by_reference.setdefault(reference, []).append(hit)
    return {
        "exact_match": float(exact["exact_match"]),
        "pass_rate": sum(passed) / len(passed) if passed else 0.0,
        "by_reference": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_reference.items())},
    }


def measure(run_dir: Path, prompts: int, samples: int) -> dict[str, Any]:
    import torch

    from finetune.core import rewards
    from finetune.data.stage import load_prepared
    from finetune.evaluation.stage import task_items
    from finetune.modeling.models import load_tokenizer
    from finetune.modeling.variants import load_variant
    from finetune.rundir.state import load_config

    cfg = load_config(run_dir)
    run_rewards = rewards.for_objective(cfg)
    items = task_items(load_prepared(run_dir)[1], prompts)
    tokenizer = load_tokenizer(cfg.model)
    greedy = replace(cfg.eval, greedy=True, progress=False)
    sampled = replace(
        cfg.eval,
        greedy=False,
        temperature=cfg.objective.temperature,
        top_p=1.0,
        max_new_tokens=cfg.objective.max_completion_length,
        progress=False,
    )
    row: dict[str, Any] = {"run": str(run_dir), "prompts": len(items), "samples": samples}
    for variant in ("base", "trained"):
        model = load_variant(cfg, run_dir, variant).to(torch.float32).eval()
        greedy_scores = score(model, tokenizer, items, greedy, run_rewards)
        row[f"{variant}_greedy"] = greedy_scores["pass_rate"]
        row[f"{variant}_greedy_exact_match"] = greedy_scores["exact_match"]
        row[f"{variant}_greedy_by_reference"] = greedy_scores["by_reference"]
        each = [score(model, tokenizer, items, replace(sampled, seed=s), run_rewards) for s in range(samples)]
        row[f"{variant}_sampled"] = statistics.mean(e["pass_rate"] for e in each)
        row[f"{variant}_sampled_each"] = [e["pass_rate"] for e in each]
        row[f"{variant}_sampled_exact_match"] = statistics.mean(e["exact_match"] for e in each)
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
        "| run | prompts | samples | base greedy | trained greedy | base sampled | trained sampled | gain greedy "
        "| gain sampled | exact match greedy, base -> trained |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {Path(r['run']).name} | {r['prompts']} | {r['samples']} | {r['base_greedy']:.3f} | "
            f"{r['trained_greedy']:.3f} | {r['base_sampled']:.3f} | {r['trained_sampled']:.3f} | "
            f"{r['trained_greedy'] - r['base_greedy']:+.3f} | {r['trained_sampled'] - r['base_sampled']:+.3f} | "
            f"{r['base_greedy_exact_match']:.3f} -> {r['trained_greedy_exact_match']:.3f} |"
        )
    for r in rows:
        for variant in ("base", "trained"):
            print(
                f"{Path(r['run']).name} {variant} greedy pass rate per reference: {r[f'{variant}_greedy_by_reference']}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
