"""GRPO on the CPU: what share of each training step is generation (transformers' generation in the trainer).

    python scripts/bench_grpo_generation.py              # tiny model, completions of 8, 32 and 64 tokens
    python scripts/bench_grpo_generation.py --quick      # one case, 2 steps (what the tests run)
    python scripts/bench_grpo_generation.py --json out.json

Each case trains TRL's GRPOTrainer (LoRA r8 on q/v, bf16 on the CPU, one process) on the bundled prompts
for a few steps, with exact match as the reward. The step time is TRL's own (`step_time`, the wall time
of `training_step`, which samples the round, scores it and trains); the generation time is the wall
time of TRL's `_generate` (the sampling alone), the rollout time that of `_generate_and_score_completions`
(sampling, rewards, the old log-probabilities). Both are measured by wrapping those methods on the
trainer instance; the first step (warm-up) is left out, and medians over the other steps are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (max_completion_length, num_generations, prompts a step)
CASES = [(8, 4, 2), (32, 4, 2), (64, 4, 2)]
QUICK = [(8, 4, 1)]


def _timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)

    return wrapper


def run_case(completion: int, generations: int, prompts: int, steps: int, out: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from finetune.core import tasks
    from finetune.core.config import ModelConfig
    from finetune.core.config.grpo import GRPOObjective
    from finetune.core.rewards import resolve
    from finetune.modeling import tiny
    from finetune.train.grpo_trainer import build_grpo_config, build_grpo_trainer, prompt_rows

    torch.manual_seed(0)
    model_cfg = ModelConfig()
    tokenizer = tiny.load_tokenizer(model_cfg)
    model = tiny.load_model(model_cfg, dtype=torch.bfloat16)
    dataset = Dataset.from_list(prompt_rows(tasks.generate(64, 0)))
    grpo = GRPOObjective(
        rewards=["exact_match"], num_generations=generations, max_completion_length=completion
    )
    rewards = resolve(grpo.rewards)
    args = build_grpo_config(
        grpo,
        rewards,
        out,
        generation="transformers",
        per_device_train_batch_size=generations * prompts,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=5e-3,
        logging_steps=1,
        report_to=[],
        bf16=True,
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = build_grpo_trainer(model, tokenizer, dataset, rewards, args, lora)
    generate: list[float] = []
    rollout: list[float] = []
    trainer._generate = _timed(generate, trainer._generate)
    trainer._generate_and_score_completions = _timed(rollout, trainer._generate_and_score_completions)
    trainer.train()
    step = [float(h["step_time"]) for h in trainer.state.log_history if "step_time" in h]
    # one generation round a step here (steps_per_generation = accumulation = 1); the first step warms up
    keep = slice(1, None) if len(step) > 1 else slice(None)
    step_s, gen_s, roll_s = (statistics.median(x[keep]) for x in (step, generate, rollout))
    lengths = [
        float(h["completions/mean_length"])
        for h in trainer.state.log_history
        if "completions/mean_length" in h
    ]
    return {
        "max_completion_length": completion,
        "completions_per_step": generations * prompts,
        "mean_completion_length": statistics.mean(lengths[keep]),
        "steps_measured": len(step[keep]),
        "step_s": step_s,
        "generate_s": gen_s,
        "rollout_s": roll_s,
        "generation_share": gen_s / step_s,
        "rollout_share": roll_s / step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cases, steps = (QUICK, 2) if args.quick else (CASES, args.steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (completion, generations, prompts) in enumerate(cases):
            rows.append(run_case(completion, generations, prompts, steps, Path(tmp) / str(i)))
    print(
        f"GRPO generation share of the step, CPU ({torch.get_num_threads()} thread(s)), tiny model, medians"
    )
    print(
        "| max completion | completions / step | mean length | steps | step s | generate s | rollout s "
        "| generation share | rollout share |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['max_completion_length']} | {r['completions_per_step']} | {r['mean_completion_length']:.1f} "
            f"| {r['steps_measured']} | {r['step_s']:.3f} | {r['generate_s']:.3f} | {r['rollout_s']:.3f} "
            f"| {r['generation_share']:.0%} | {r['rollout_share']:.0%} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
