"""Evaluation (`mode=eval`): base vs fine-tuned vs merged on the same prompts, template and sampling.

`finetune.evaluation.stage.run(cfg, run_dir)` writes RUN_DIR/eval/{metrics.json, samples.jsonl,
report.md, loss_curves.png}. Its settings are `EvalConfig` (finetune/core/config/evaluation.py).
"""
