"""finetune: one command from a named recipe to an evaluated, deployable fine-tuned LLM.

The public API is small: compose a config, plan it, run it.

    from finetune import compose, make_plan
"""

from typing import Any

__version__ = "0.1.0"

# Resolved on first use, so that `import finetune.<module>` stays light (the
# planner must import without torch, workers without Hydra).
_API = {
    "Config": "finetune.core.config",
    "compose": "finetune.core.composition",
    "main": "finetune.pipeline.cli",
    "Plan": "finetune.planner",
    "make_plan": "finetune.planner",
    "FinetuneError": "finetune.core.errors",
    "ConfigError": "finetune.core.errors",
    "PlanError": "finetune.core.errors",
    "DataError": "finetune.core.errors",
    "LaunchError": "finetune.core.errors",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")
