"""Export (`mode=export`): merge into a 16-bit base, check the logits, save shards, write serve.sh for vLLM.

`finetune.export.stage.run(cfg, run_dir, plan)` writes RUN_DIR/export/. This package's top level
imports no torch (the config layer imports it).
"""

from finetune.export.config import ExportConfig

__all__ = ["ExportConfig"]
