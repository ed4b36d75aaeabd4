"""Launching at scale: the plan becomes DeepSpeed ZeRO-3 / FSDP2 settings, run by torchrun or accelerate.

Kept light on import: `finetune.config` imports `LaunchConfig` from here.

    from finetune.launch import stage             # mode=launch: stage.run(cfg, run_dir, plan) -> exit code
    from finetune.launch.engines import engine_files   # the engine files and SFTConfig kwargs of a plan
"""

from finetune.launch.config import LaunchConfig

__all__ = ["LaunchConfig"]
