"""GRPO's training-side memory on the CPU, term by term, against the plan.

    python scripts/bench_grpo_memory.py                 # 8, 16 and 32 completions a step, one process each
    python scripts/bench_grpo_memory.py --case 8        # one case (what a quick check runs)
    python scripts/bench_grpo_memory.py --json out.json

Each case trains TRL's GRPOTrainer as `+recipe=tiny_grpo` does (the tiny model, LoRA r32 on the seven
projections, fp32 as the recipe trains on the CPU (method.precision=auto), one micro-batch of all completions,
transformers' generation in the trainer, exact match + the format reward) for 3 steps in a fresh process,
and measures step 3 (the optimizer state exists by then):

- rows: the padded rows TRL trains on, prompt + completion (`prompt_ids` and `completion_ids` widths),
  against the configured `train.seq_len` (128) the plan is made at;
- held: the distinct storages of the parameters and the optimizer state before the step;
- rollout: the peak of live tensor bytes during `_generate_and_score_completions` (sampling with its KV
  cache, the rewards, the log-probabilities under no_grad) above what was live when it began;
- training: the peak of live tensor bytes from the end of the rollout to the end of the step (the policy's
  forward through TRL's fused head, the loss, the backward), the gradients included;
- rss: the process's resident set before training and its peak (VmHWM) at the end.

The plan: the planner's tensors (weights, trainable state, activations, the loss peak and the working set
above it; `tensors_gb`, allocated bytes, as scripts/bench_planner.py counts them) and its total with the
fixed share, each at the configured seq_len and at the rows measured.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CASES = (8, 16, 32)
SEQ_LEN = 128
MB = 1e6


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1]) * 1024
    return 0.0


def measure(completions: int, out: Path) -> dict[str, Any]:
    """One case in this process (run it in a fresh one: the resident set is the process's)."""
    import torch
    from bench_planner import LiveBytes, optimizer_state_tensors, storage_bytes
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
    model = tiny.load_model(model_cfg, dtype=torch.float32)
    dataset = Dataset.from_list(prompt_rows(tasks.generate(256, 0)))
    grpo = GRPOObjective(
        rewards=["exact_match", "format:\\w+"],
        reward_weights=[1.0, 0.2],
        num_generations=4,
        max_completion_length=8,
    )
    rewards = resolve(grpo.rewards, grpo.reward_weights)
    args = build_grpo_config(
        grpo, rewards, out, generation="transformers", per_device_train_batch_size=completions,
        gradient_accumulation_steps=1, max_steps=3, learning_rate=3e-3, logging_steps=1, report_to=[],
        bf16=False, use_cpu=True, save_strategy="no", seed=0,
    )  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    trainer = build_grpo_trainer(model, tokenizer, dataset, rewards, args, lora)
    rec: dict[str, Any] = {"completions": completions, "rss_before": _status("VmRSS")}
    step = {"n": 0}
    rollout, training_step = trainer._generate_and_score_completions, trainer.training_step

    def timed_rollout(*a: Any, **k: Any) -> Any:
        tracker = step.get("tracker")
        start = tracker.live if tracker else 0
        result = rollout(*a, **k)
        if tracker:
            rec["rollout"] = tracker.peak - start
            rec["rows"] = int(result["prompt_ids"].shape[1] + result["completion_ids"].shape[1])
            rec["completion_width"] = int(result["completion_ids"].shape[1])
            tracker.peak = tracker.live  # from here on: the training part of the step
            step["after_rollout"] = tracker.live
        return result

    def measured_step(*a: Any, **k: Any) -> Any:
        step["n"] += 1
        if step["n"] != 3:
            return training_step(*a, **k)
        params = [p for p in trainer.model.parameters()]
        rec["held"] = storage_bytes(params) + storage_bytes(optimizer_state_tensors(trainer.optimizer))
        with LiveBytes() as tracker:
            step["tracker"] = tracker
            loss = training_step(*a, **k)
        step.pop("tracker")
        rec["training"] = tracker.peak
        return loss

    trainer._generate_and_score_completions = timed_rollout
    trainer.training_step = measured_step
    trainer.train()
    rec["rss_peak"] = _status("VmHWM")
    return rec


def planned(completions: int, seq_len: int) -> dict[str, float]:
    """The plan of `+recipe=tiny_grpo` with `completions` a step at `seq_len`: tensors (allocated bytes, as
    measured here) and the total with the fixed and allocator shares (what a run's peak RSS is held to)."""
    from finetune.core.composition import compose
    from finetune.pipeline.stages import config_plan, resolve
    from finetune.planner import make_job, memory, tensors_gb
    from finetune.planner.contract import GB
    from finetune.planner.job import runtime

    cfg = resolve(
        compose(["+recipe=tiny_grpo", f"train.batch_size={completions}", f"train.seq_len={seq_len}"])
    )
    plan = config_plan(cfg)
    job = make_job(
        cfg.model, cfg.method, cfg.hardware, cfg.train, seq_len, plan=cfg.plan, objective=cfg.objective.spec
    )
    s = plan.strategy
    rt = replace(runtime(job, s), resident=False)
    mem, _ = memory(job, s, rt)
    return {
        "tensors": tensors_gb(job, s, rt) * GB,
        "activations": mem.activations * GB,
        "logits": mem.logits * GB,
        "total": plan.gpu_memory.total * GB,
        "micro_batch_size": s.micro_batch_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=int, help="one case: completions a step")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(measure(args.case, Path(tmp))))
        return
    rows = []
    for completions in (args.case,) if args.case else CASES:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", "--case", str(completions)],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"case {completions} failed:\n{proc.stderr[-3000:]}")
        rec = json.loads(proc.stdout.strip().splitlines()[-1])
        rec["plan_configured"] = planned(completions, SEQ_LEN)
        rec["plan_rows"] = planned(completions, rec["rows"])
        rows.append(rec)
    print(
        "GRPO training side, CPU, tiny model (MB; plan at the configured seq_len 128 / at the rows measured)"
    )
    print(
        "| completions | rows (prompt + completion) | held + training (measured tensors) | plan tensors "
        "| rollout above entry | RSS before / peak | plan total | error of the plan total vs peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = r["held"] + r["training"]
        pc, pr = r["plan_configured"], r["plan_rows"]
        print(
            f"| {r['completions']} | {r['rows']} ({r['completion_width']} completion) | {measured / MB:.1f} "
            f"| {pc['tensors'] / MB:.1f} / {pr['tensors'] / MB:.1f} | {r['rollout'] / MB:.1f} "
            f"| {r['rss_before'] / MB:.0f} / {r['rss_peak'] / MB:.0f} | {pc['total'] / MB:.0f} / {pr['total'] / MB:.0f} "
            f"| {(pc['total'] - r['rss_peak']) / r['rss_peak']:+.1%} / {(pr['total'] - r['rss_peak']) / r['rss_peak']:+.1%} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
