"""Framework overhead per training step: finetune's worker against a plain TRL script, same settings.

    python scripts/bench_overhead.py                 # 3 interleaved pairs of 60 steps each
    python scripts/bench_overhead.py --pairs 5 --steps 100

Both sides train the tiny recipe's LoRA on the same packed rows the data stage
wrote, the same model, LoRA config, batch, learning rate, optimizer and thread
count; each runs in its own process, alternating (finetune, plain, finetune,
plain, ...) so machine noise hits both alike. Neither evaluates nor saves inside
the measured loop (eval/save intervals beyond the run); both evaluate and save a checkpoint once
at the end, as transformers does with step intervals.

Two figures a run: the loop (from the first step's start to the last step's end,
over the steps: finetune's `loop_seconds` in metrics.json, the plain script's own
callback), which is the per-step overhead; and the whole `train()` call over the
steps (finetune's `train_seconds`, the plain script's `train_runtime`), which adds
set-up and the one end-of-run evaluation and checkpoint. Prints medians and the
overhead ratios. Target: at most 5% per step.
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
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer
    from finetune.rundir import load_config
    from finetune.modeling.tiny import load_model, load_tokenizer
    from finetune.data.stage import load_prepared

    run_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    cfg = load_config(run_dir)
    plan = json.load(open(f"{run_dir}/plan.json"))["strategy"]
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, torch.float32)
    m = cfg.method
    model = get_peft_model(model, LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                                              target_modules=m.targets(cfg.model.architecture), task_type="CAUSAL_LM"))
    train, held_out = load_prepared(run_dir)

    def collate(rows):
        n = max(len(r["input_ids"]) for r in rows)
        pad = lambda key, v: torch.tensor([r[key] + [v] * (n - len(r[key])) for r in rows])
        pos = [r.get("position_ids") or list(range(len(r["input_ids"]))) for r in rows]
        batch = {"input_ids": pad("input_ids", tokenizer.pad_token_id), "labels": pad("labels", -100),
                 "position_ids": torch.tensor([p + list(range(n - len(p))) for p in pos])}
        batch["labels"][batch["position_ids"] == 0] = -100
        return batch

    class Loop(TrainerCallback):  # first step's start to last step's end
        def on_train_begin(self, *a, **k): self.start = time.perf_counter()
        def on_step_end(self, *a, **k): self.seconds = time.perf_counter() - self.start

    args = SFTConfig(output_dir=f"{run_dir}/plain", per_device_train_batch_size=plan["micro_batch_size"],
                     gradient_accumulation_steps=plan["grad_accum_steps"], learning_rate=m.learning_rate,
                     lr_scheduler_type=cfg.train.lr_scheduler, warmup_steps=cfg.train.warmup_ratio,
                     max_steps=steps, logging_steps=cfg.train.logging_steps, save_strategy="steps", save_steps=10**6,
                     eval_strategy="steps", eval_steps=10**6, per_device_eval_batch_size=plan["micro_batch_size"],
                     weight_decay=m.weight_decay, max_grad_norm=cfg.train.max_grad_norm,
                     report_to=[], use_cpu=True, seed=cfg.train.seed, optim="adamw_torch", remove_unused_columns=False,
                     bf16=False, activation_checkpointing=False, packing=False, padding_free=False,
                     train_sampling_strategy="sequential", logging_first_step=True,
                     dataset_kwargs={"skip_prepare_dataset": True}, disable_tqdm=True, max_length=None)
    loop = Loop()
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out, processing_class=tokenizer,
                         data_collator=collate, callbacks=[loop])
    result = trainer.train()
    json.dump({"steps": result.global_step, "seconds": result.metrics["train_runtime"], "loop_seconds": loop.seconds},
              open(out, "w"))
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... exited with {r.returncode}:\n{r.stderr[-3000:]}")


def finetune_step_seconds(run_dir: Path, steps: int) -> tuple[float, float]:
    """(loop, whole train()) seconds per step of one `python -m finetune mode=train` run."""
    _run([sys.executable, "-m", "finetune", f"run_dir={run_dir}", "mode=train", "resume=false",
          f"train.max_steps={steps}", "train.save_steps=1000000", "train.eval_steps=1000000"])  # fmt: skip
    train = json.loads((run_dir / "metrics.json").read_text())["train"]
    return train["loop_seconds"] / train["steps"], train["train_seconds"] / train["steps"]


def plain_step_seconds(run_dir: Path, steps: int, script: Path) -> tuple[float, float]:
    """(loop, whole train()) seconds per step of one run of the plain script."""
    out = run_dir / "plain.json"
    _run([sys.executable, str(script), str(run_dir), str(steps), str(out)])
    result = json.loads(out.read_text())
    return result["loop_seconds"] / result["steps"], result["seconds"] / result["steps"]


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
        for mode in ("data", "plan"):
            subprocess.run(
                [sys.executable, "-m", "finetune", f"run_dir={run_dir}", f"mode={mode}"],
                cwd=ROOT, env=_env(), check=True, capture_output=True,
            )  # fmt: skip
        ours, plain = [], []
        for i in range(args.pairs):
            ours.append(finetune_step_seconds(run_dir, args.steps))
            plain.append(plain_step_seconds(run_dir, args.steps, script))
            print(
                f"pair {i + 1}: loop ms/step finetune {ours[-1][0] * 1e3:.1f}, plain {plain[-1][0] * 1e3:.1f}; "
                f"train() ms/step finetune {ours[-1][1] * 1e3:.1f}, plain {plain[-1][1] * 1e3:.1f}"
            )
    print(f"\n{args.steps} steps a run, {args.pairs} interleaved pairs\n")
    print("| figure | runner | median ms/step | min ms/step |")
    print("|---|---|---:|---:|")
    for k, figure in enumerate(("training loop", "whole train() (set-up, end-of-run eval and save)")):
        a = statistics.median(r[k] for r in ours)
        b = statistics.median(r[k] for r in plain)
        print(f"| {figure} | finetune | {a * 1e3:.1f} | {min(r[k] for r in ours) * 1e3:.1f} |")
        print(f"| {figure} | plain TRL + PEFT | {b * 1e3:.1f} | {min(r[k] for r in plain) * 1e3:.1f} |")
        ratios = sorted((o[k] - p[k]) / p[k] for o, p in zip(ours, plain))
        print(
            f"| {figure} | **overhead** | {100 * (a - b) / b:+.1f}% | pairs: "
            + ", ".join(f"{100 * r:+.1f}%" for r in ratios)
            + " |"
        )


if __name__ == "__main__":
    main()
