"""Training: model loading per method, the TRL trainer, the exact chunked loss, evaluation.

- model loading (full / LoRA / QLoRA) is finetune/models.py, shared with evaluation, export and data
- `trainer`: `SFTConfig` from the config and the plan; `FinetuneTrainer` (chunked loss, token counting)
- `collator`: batches of packed, pre-tokenized rows (block-diagonal attention from position ids)
- `callbacks`: throughput and memory against the plan, early stops, rich progress
- `evaluate`: held-out loss and greedy exact match, base vs trained
- `chunked_loss`: the causal-LM loss without full logits
- `stage`: `run(cfg, run_dir, plan)`, the stage; `python -m finetune.train RUN_DIR` is the per-rank worker
"""
