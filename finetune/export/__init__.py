"""Export (`mode=export`): merge into a 16-bit base, check the logits, save shards, write serve.sh for vLLM.

`finetune.export.stage.run(cfg, run_dir, plan)` writes RUN_DIR/export/. Its settings are `ExportConfig`
(finetune/core/config/export.py).
"""
