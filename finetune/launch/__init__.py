"""Launching at scale: the plan becomes DeepSpeed ZeRO-3 / FSDP2 settings, run by torchrun or accelerate.

    from finetune.launch import stage                       # mode=launch: stage.run(cfg, run_dir, plan) -> exit code
    from finetune.launch.engines import write_engine_files  # the engine files and SFTConfig kwargs of a plan

Its settings are `LaunchConfig` (finetune/core/config/launch.py).
"""
