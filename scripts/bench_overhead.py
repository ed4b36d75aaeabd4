"""Framework overhead per training step: finetune's worker against a plain TRL script, same settings.

    python scripts/bench_overhead.py                 # 3 interleaved pairs of 60 steps each
    python scripts/bench_overhead.py --pairs 5 --steps 100

Both sides train the tiny recipe's LoRA on the same packed rows the data stage
wrote, the same model, LoRA config, batch, learning rate, optimizer and thread
count; each runs in its own process, alternating (finetune, plain, finetune,
plain, ...) so machine noise hits both alike. Neither evaluates nor saves inside
the measured loop (finetune: eval/save intervals beyond the run). Per-step time is the training
loop's time over its steps (finetune: `train_seconds` in metrics.json; plain:
Trainer's `train_runtime`). Prints medians and the overhead ratio. Target
(issue 8): at most 5% per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The baseline a user would write by hand with TRL + PEFT: no finetune code in the loop.
PLAIN = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from peft import LoraConfig, get_peft_model
    from trl import SFTConfig, SFTTrainer
    from finetune.rundir import load_config
    from finetune.tiny import load_model, load_tokenizer
    from finetune.data.stage import load_prepared

    run_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    cfg = load_config(run_dir)
    plan = json.load(open(f"{run_dir}/plan.json"))["strategy"]
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, torch.float32)
    m = cfg.method
    model = get_peft_model(model, LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                                              target_modules=list(m.target_modules), task_type="CAUSAL_LM"))
    train, _ = load_prepared(run_dir)

    def collate(rows):
        n = max(len(r["input_ids"]) for r in rows)
        pad = lambda key, v: torch.tensor([r[key] + [v] * (n - len(r[key])) for r in rows])
        batch = {"input_ids": pad("input_ids", tokenizer.pad_token_id), "labels": pad("labels", -100),
                 "position_ids": torch.tensor([r["position_ids"] + list(range(n - len(r["position_ids"]))) for r in rows])}
        batch["labels"][batch["position_ids"] == 0] = -100
        return batch

    args = SFTConfig(output_dir=f"{run_dir}/plain", per_device_train_batch_size=plan["micro_batch_size"],
                     gradient_accumulation_steps=plan["grad_accum_steps"], learning_rate=m.learning_rate,
                     lr_scheduler_type=cfg.train.lr_scheduler, warmup_steps=cfg.train.warmup_ratio,
                     max_steps=steps, logging_steps=cfg.train.logging_steps, save_strategy="no", eval_strategy="no",
                     report_to=[], use_cpu=True, seed=cfg.train.seed, optim="adamw_torch", remove_unused_columns=False,
                     bf16=False, activation_checkpointing=False, packing=False, padding_free=False,
                     train_sampling_strategy="sequential", logging_first_step=True,
                     dataset_kwargs={"skip_prepare_dataset": True}, disable_tqdm=True, max_length=None)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, data_collator=collate)
    result = trainer.train()
    json.dump({"steps": result.global_step, "seconds": result.metrics["train_runtime"]}, open(out, "w"))
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... exited with {r.returncode}:\n{r.stderr[-3000:]}")


def finetune_step_seconds(run_dir: Path, steps: int) -> float:
    _run([sys.executable, "-m", "finetune", f"run_dir={run_dir}", "mode=train", "resume=false",
          f"train.max_steps={steps}", "train.save_steps=1000000", "train.eval_steps=1000000"])  # fmt: skip
    train = json.loads((run_dir / "metrics.json").read_text())["train"]
    return train["train_seconds"] / train["steps"]


def plain_step_seconds(run_dir: Path, steps: int, script: Path) -> float:
    out = run_dir / "plain.json"
    _run([sys.executable, str(script), str(run_dir), str(steps), str(out)])
    result = json.loads(out.read_text())
    return result["seconds"] / result["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        script = Path(tmp) / "plain_trl.py"
        script.write_text(PLAIN)
        subprocess.run(
            [sys.executable, "-m", "finetune", f"run_dir={run_dir}", "mode=data"],
            cwd=ROOT, env=_env(), check=True, capture_output=True,
        )  # fmt: skip
        subprocess.run(
            [sys.executable, "-m", "finetune", f"run_dir={run_dir}", "mode=plan"],
            cwd=ROOT, env=_env(), check=True, capture_output=True,
        )  # fmt: skip
        ours, plain = [], []
        for i in range(args.pairs):
            ours.append(finetune_step_seconds(run_dir, args.steps))
            plain.append(plain_step_seconds(run_dir, args.steps, script))
            print(
                f"pair {i + 1}: finetune {ours[-1] * 1e3:.1f} ms/step, plain TRL {plain[-1] * 1e3:.1f} ms/step"
            )
    a, b = statistics.median(ours), statistics.median(plain)
    print()
    print("| runner | median ms/step | min ms/step | runs |")
    print("|---|---:|---:|---:|")
    print(
        f"| finetune (`python -m finetune mode=train`) | {a * 1e3:.1f} | {min(ours) * 1e3:.1f} | {len(ours)} |"
    )
    print(f"| plain TRL + PEFT script | {b * 1e3:.1f} | {min(plain) * 1e3:.1f} | {len(plain)} |")
    print(f"| overhead per step | {100 * (a - b) / b:+.1f}% | | |")


if __name__ == "__main__":
    main()
