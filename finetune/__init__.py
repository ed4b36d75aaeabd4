"""finetune: one command from a named recipe to an evaluated, deployable fine-tuned LLM.

The public API is small: compose a config, plan it, run it.

    from finetune import compose, make_plan
"""

from typing import Any

__version__ = "0.1.0"

# Resolved on first use, so that `import finetune.<module>` stays light (the
# planner must import without torch, workers without Hydra).
_API = {
    "Config": "finetune.config",
    "compose": "finetune.hydra_config",
    "main": "finetune.cli",
    "Plan": "finetune.planner",
    "make_plan": "finetune.planner",
    "FinetuneError": "finetune.errors",
    "ConfigError": "finetune.errors",
    "PlanError": "finetune.errors",
    "DataError": "finetune.errors",
    "LaunchError": "finetune.errors",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")
