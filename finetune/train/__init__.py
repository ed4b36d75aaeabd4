"""Training: the per-rank worker, TRL's trainer as the plan sets it up, the callbacks that watch it.

- `stage`: `run(cfg, run_dir, plan)`, the stage; `python -m finetune.train RUN_DIR` is the per-rank worker
- `trainer`: `SFTConfig` from the config and the plan; `FinetuneTrainer` (chunked loss, token counting,
  atomic checkpoints)
- `callbacks`: throughput and memory against the plan, early stops, preemption, rich progress
- `throughput`: the train.* speed switches (attention, Liger, compile, fused optimizer)
- `profiling`: train.profile's per-phase step timing

Shared with the other stages, one layer down: model loading (finetune/modeling/models.py), the chunked loss
(finetune/modeling/chunked_loss.py), the collator of packed rows (finetune/modeling/collator.py); the base-vs-trained
evaluation is finetune/evaluation/heldout.py.
"""
