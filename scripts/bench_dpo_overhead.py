"""Framework overhead per DPO step: finetune's worker against a plain TRL DPOTrainer script, same work.

    python scripts/bench_dpo_overhead.py                 # 3 interleaved pairs of 20 steps each
    python scripts/bench_dpo_overhead.py --pairs 5 --steps 40
    python scripts/bench_dpo_overhead.py --quick         # 1 pair of 2 steps: that both sides run (the tests)

Both sides train the tiny_dpo recipe (LoRA r32 on the tiny model, fp32 on the CPU, 32 pairs a micro-batch,
TRL's sigmoid loss, beta 0.1, the base with the adapter disabled as the reference) on the same tokenized pairs
the data stage wrote, with the same model, LoRA config, batch, learning rate, schedule, optimizer and thread
count; each runs in its own process, alternating (finetune, plain, finetune, plain, ...) so machine noise hits
both alike. The plain script is what a user writes with TRL + PEFT, its arguments set to the plan's: it skips
TRL's tokenization (`_prepare_dataset`), since the pairs arrive tokenized, as they do for finetune, and turns off
the activation checkpointing DPOConfig turns on by default (the plan does not checkpoint this recipe: left on,
the plain side recomputed every forward and ran 21% slower a step, which read as finetune being faster).
Neither evaluates nor saves inside the measured loop. Every pair compares the two sides' DPOConfig field by
field (finetune's from the checkpoint's training_args.bin) and stops on any difference but the output folders.

Both sides run under one probe (scripts/trainer_loop_probe.py: finetune's side is the worker `mode=train`
starts, on the config it writes), which reads from the first step's start to the last step's end: the wall
clock, the process's user and system CPU seconds (every thread: on a 2-core machine shared with other tenants
the wall clock measures them too, the CPU time mostly the process's own work), its minor page faults, the
garbage collector's seconds and the callbacks' on_step_end; and the whole `train()` call over the steps
(set-up and the end-of-run evaluation and checkpoint included). `--off tensorboard,...` switches parts of
finetune's worker off (ablations, to find what a step's extra time belongs to). The pairs run A B, B A, A B, ...
Prints medians, the overhead of the medians and each pair's. Target: within 3% per step.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "scripts" / "trainer_loop_probe.py"
RECIPE = "+recipe=tiny_dpo"

# The baseline a user would write by hand with TRL + PEFT: no finetune code in the loop (the run directory's
# config, tokenizer and prepared pairs are read with finetune's helpers, outside it).
PLAIN = textwrap.dedent(
    """
    import json, sys
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from finetune.rundir import load_config
    from finetune.modeling.tiny import load_model, load_tokenizer
    from finetune.data.stage import load_prepared

    run_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    cfg = load_config(run_dir)
    plan = json.load(open(f"{run_dir}/plan.json"))["strategy"]
    tokenizer = load_tokenizer(cfg.model)
    set_seed(cfg.train.seed)  # the adapter's random init, as finetune seeds it
    model = load_model(cfg.model, torch.float32)
    m = cfg.method
    model = get_peft_model(model, LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                                              target_modules=m.targets(cfg.model.architecture), task_type="CAUSAL_LM"))
    train, held_out = load_prepared(run_dir)

    class Pretokenized(DPOTrainer):  # the pairs are tokenized already (prompt_ids, chosen_ids, rejected_ids)
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

    d = cfg.objective
    args = DPOConfig(output_dir=f"{run_dir}/plain", per_device_train_batch_size=plan["micro_batch_size"],
                     gradient_accumulation_steps=plan["grad_accum_steps"], learning_rate=m.learning_rate,
                     lr_scheduler_type=cfg.train.lr_scheduler, warmup_steps=cfg.train.warmup_ratio,
                     max_steps=steps, logging_steps=cfg.train.logging_steps, save_strategy="steps", save_steps=10**6,
                     eval_strategy="steps", eval_steps=10**6, per_device_eval_batch_size=plan["micro_batch_size"],
                     weight_decay=m.weight_decay, max_grad_norm=cfg.train.max_grad_norm,
                     report_to=[], use_cpu=True, seed=cfg.train.seed, optim="adamw_torch", remove_unused_columns=False,
                     bf16=False, train_sampling_strategy="sequential", logging_first_step=True, disable_tqdm=True,
                     beta=d.beta, loss_type=[d.loss_type], label_smoothing=d.label_smoothing, max_length=None,
                     padding_free=False, disable_dropout=True, precompute_ref_log_probs=False,
                     # DPOConfig turns activation checkpointing on by default (TRL's one default that differs from
                     # TrainingArguments here); the plan turns it off for this recipe, so the plain side follows it.
                     activation_checkpointing=plan["activation_checkpointing"], data_seed=cfg.train.seed,
                     num_train_epochs=cfg.train.epochs,
                     ddp_find_unused_parameters=False)
    trainer = Pretokenized(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                           processing_class=tokenizer,
                           data_collator=DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id))
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    json.dump({"steps": result.global_step, "seconds": result.metrics["train_runtime"],
               "first_loss": losses[0], "last_loss": losses[-1], "threads": torch.get_num_threads(),
               "args": args.to_dict()}, open(out, "w"), default=str)
    """
)


# Environment variables set for both sides alike (`--env NAME=VALUE`): glibc's malloc tunables, torch's
# THP_MEM_ALLOC_ENABLE, to see whether a difference between the sides lives in the allocator's state.
EXTRA_ENV: dict[str, str] = {}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **EXTRA_ENV}


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... exited with {r.returncode}:\n{r.stderr[-3000:]}")


def _probe(out: Path, off: list[str], *command: str) -> dict[str, Any]:
    """`command` under the loop probe (scripts/trainer_loop_probe.py, the same for both sides); its figures."""
    _run([sys.executable, str(PROBE), str(out), "--off", ",".join(off), *command])
    return json.loads(out.read_text())


def finetune_run(run_dir: Path, steps: int, off: list[str]) -> dict[str, Any]:
    """Seconds per step (loop, whole train()), the probe's figures, the first and last logged loss and the
    trainer's arguments of one run of the worker `python -m finetune mode=train` starts (the planned config)."""
    import torch

    probe = _probe(run_dir / "probe_finetune.json", off, "-m", "finetune.train", str(run_dir))
    train = json.loads((run_dir / "metrics.json").read_text())["train"]
    checkpoint = run_dir / "checkpoints" / f"checkpoint-{steps}"
    history = json.loads((checkpoint / "trainer_state.json").read_text())
    losses = [h["loss"] for h in history["log_history"] if "loss" in h]
    # The DPOConfig the run trained with, as the Trainer saved it (a pickled dataclass: this run's own file).
    args = torch.load(checkpoint / "training_args.bin", weights_only=False).to_dict()
    return dict(
        probe,
        loop=probe["wall"],
        whole=train["train_seconds"] / train["steps"],
        first_loss=losses[0],
        last_loss=losses[-1],
        args=json.loads(json.dumps(args, default=str)),
    )


def plain_run(run_dir: Path, steps: int, script: Path) -> dict[str, Any]:
    """The same figures for one run of the plain script."""
    out = run_dir / "plain.json"
    probe = _probe(run_dir / "probe_plain.json", [], str(script), str(run_dir), str(steps), str(out))
    r = json.loads(out.read_text())
    return dict(
        probe,
        loop=probe["wall"],
        whole=r["seconds"] / r["steps"],
        first_loss=r["first_loss"],
        last_loss=r["last_loss"],
        args=r["args"],
    )


# Arguments that may differ, all about saving (neither saves inside the measured loop): where each side writes,
# and the checkpoint rotation (finetune rotates its own, so the arguments it saves carry save_total_limit unset).
_SAVING = {"output_dir", "logging_dir", "save_total_limit"}


def argument_differences(ours: dict[str, Any], plain: dict[str, Any]) -> list[str]:
    """The DPOConfig fields the two sides set differently, as `name: finetune != plain` (empty: the same work)."""
    keys = sorted((set(ours) | set(plain)) - _SAVING)
    return [f"{k}: {ours.get(k)!r} != {plain.get(k)!r}" for k in keys if ours.get(k) != plain.get(k)]


def table(ours: list[dict[str, Any]], plain: list[dict[str, Any]]) -> str:
    lines = ["| figure | runner | median ms/step | min ms/step |", "|---|---|---:|---:|"]
    for key, figure in (
        ("loop", "training loop"),
        ("cpu", "training loop, process CPU time"),
        ("user", "training loop, user CPU"),
        ("system", "training loop, system CPU (page faults, madvise)"),
        ("whole", "whole train() (set-up, end-of-run eval and save)"),
    ):
        a = statistics.median(r[key] for r in ours)
        b = statistics.median(r[key] for r in plain)
        lines.append(f"| {figure} | finetune | {a * 1e3:.1f} | {min(r[key] for r in ours) * 1e3:.1f} |")
        lines.append(
            f"| {figure} | plain TRL + PEFT | {b * 1e3:.1f} | {min(r[key] for r in plain) * 1e3:.1f} |"
        )
        ratios = sorted((o[key] - p[key]) / p[key] for o, p in zip(ours, plain))
        lines.append(
            f"| {figure} | **overhead** | {100 * (a - b) / b:+.1f}% | pairs: "
            + ", ".join(f"{100 * r:+.1f}%" for r in ratios)
            + " |"
        )
    for key, figure, scale, unit in (
        ("minor_faults", "minor page faults", 1, "a step"),
        ("step_end_callbacks", "callbacks' on_step_end", 1e3, "ms a step"),
        ("gc", "Python's garbage collector", 1e3, "ms a step"),
    ):
        a = statistics.median(r[key] for r in ours) * scale
        b = statistics.median(r[key] for r in plain) * scale
        lines.append(f"| {figure} ({unit}, median) | finetune {a:,.1f} | plain {b:,.1f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="1 pair of 2 steps")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument(
        "--off",
        default="",
        help="switch parts of finetune's worker off, to find where a step's time goes (comma-separated: "
        "tensorboard, callbacks, token_count; scripts/trainer_loop_probe.py)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for both sides alike (repeatable), e.g. MALLOC_TRIM_THRESHOLD_=...",
    )
    args = parser.parse_args(argv)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env {item!r}: expected NAME=VALUE")
        EXTRA_ENV[name] = value
    pairs, steps = (1, 2) if args.quick else (args.pairs, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        script = Path(tmp) / "plain_trl_dpo.py"
        script.write_text(PLAIN)
        off = [p for p in args.off.split(",") if p]
        # The config the worker reads: mode=train with these overrides writes the same, then starts it.
        overrides = [
            "resume=false",
            f"train.max_steps={steps}",
            "train.save_steps=1000000",
            "train.eval_steps=1000000",
        ]
        # The data, the plan and the engine files (launch.dry_run writes them and starts nothing).
        for step in (["mode=data"], ["mode=plan"], ["mode=launch", "launch.dry_run=true"]):
            subprocess.run(
                [sys.executable, "-m", "finetune", RECIPE, f"run_dir={run_dir}", *step, *overrides],
                cwd=ROOT, env=_env(), check=True, capture_output=True,
            )  # fmt: skip
        ours, plain = [], []
        for i in range(pairs):
            # A B, then B A: a load that rises or falls through the run weighs on both sides alike.
            if i % 2 == 0:
                ours.append(finetune_run(run_dir, steps, off))
                plain.append(plain_run(run_dir, steps, script))
            else:
                plain.append(plain_run(run_dir, steps, script))
                ours.append(finetune_run(run_dir, steps, off))
            print(
                f"pair {i + 1}: loop ms/step finetune {ours[-1]['loop'] * 1e3:.1f}, "
                f"plain {plain[-1]['loop'] * 1e3:.1f}; CPU ms/step finetune {ours[-1]['cpu'] * 1e3:.1f}, "
                f"plain {plain[-1]['cpu'] * 1e3:.1f}; loss first/last finetune {ours[-1]['first_loss']:.4f}/"
                f"{ours[-1]['last_loss']:.4f}, plain {plain[-1]['first_loss']:.4f}/{plain[-1]['last_loss']:.4f}",
                flush=True,
            )
            differences = argument_differences(ours[-1]["args"], plain[-1]["args"])
            if differences:
                # Not the same work: a ratio would measure the difference, not the framework.
                sys.exit("the two sides' DPOConfig differ:\n  " + "\n  ".join(differences))
    print(
        f"\n{steps} DPO steps a run ({RECIPE}), {pairs} interleaved pair(s); finetune's parts off: {off or 'none'}; "
        f"environment for both: {EXTRA_ENV or 'as inherited'}\n"
    )
    print(table(ours, plain))
    if args.json:
        runs = {
            side: [{k: v for k, v in r.items() if k != "args"} for r in rs]
            for side, rs in (("finetune", ours), ("plain", plain))
        }
        args.json.write_text(json.dumps(dict(steps=steps, off=off, env=EXTRA_ENV, **runs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
