"""Launching at scale: the plan becomes DeepSpeed ZeRO-3 / FSDP2 settings, run by torchrun or accelerate.

Kept light on import: `finetune.config` imports `LaunchConfig` from here, so the
rest (which imports `finetune.config`) loads on first use.

    from finetune.launch import engine_files      # each rank's trainer: files + SFTConfig kwargs
    from finetune.launch import stage             # mode=launch: stage.run(cfg, run_dir, plan) -> exit code
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from finetune.launch.config import LaunchConfig


def engine_files(plan: Any, run_dir: Union[str, Path], cfg: Optional[Any] = None) -> dict[str, Any]:
    """See `finetune.launch.engines.engine_files`."""
    from finetune.launch.engines import engine_files as _engine_files

    return _engine_files(plan, run_dir, cfg)


__all__ = ["LaunchConfig", "engine_files"]
