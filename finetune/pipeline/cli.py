"""Entry point: compose the Hydra config once, validate it, run the requested stages.

    python -m finetune                                      # embedded default: tiny recipe on the CPU
    python -m finetune +recipe=llama70b_qlora mode=plan     # will it fit, and how should it run?
    python -m finetune mode=plan model=llama3_1_8b method=lora hardware=auto train.seq_len=8192 plan.out=plan.json
    python -m finetune mode=ui                              # the planner and the runs as a local web page
    python -m finetune model=Qwen/Qwen2.5-0.5B-Instruct mode=plan   # a hub id, or a folder: model=/models/my-sft
    python -m finetune init my.yaml                         # a commented config file of your own, then:
    python -m finetune my.yaml train.seq_len=1024           # that file, overrides on top
    python -m finetune mode=chat                            # talk to the trained model (chat.model=base|merged)

Bad input ends with a one-line message naming the key and exit code 2; no traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from finetune.core.composition import compose, group_choices, recipe_names, user_files
from finetune.core.config import Config
from finetune.core.errors import (
    INTERRUPTED_EXIT_CODE,
    DiskFullError,
    FinetuneError,
    interrupt_on_signals,
    is_disk_full,
)
from finetune.core.markup import terminal_line
from finetune.core.noise import quiet_libraries
from finetune.core.secrets import install_log_filter
from finetune.pipeline import smoke, stages, starter
from finetune.rundir import free_bytes
from finetune.ui import server as ui_server

__all__ = ["compose", "main", "run"]


def run(cfg: Config) -> int:
    return stages.run(cfg)


def chat(cfg: Config) -> int:
    """`mode=chat`: the run's model in the terminal. The chat module loads torch and transformers on import,
    so it is imported here, when it runs (as the pipeline imports the evaluation stage)."""
    quiet_libraries(cfg.verbose)  # before the libraries load: their notices are the evaluation's noise too
    from finetune.evaluation import chat as chat_module

    cfg = stages.resolve(cfg)
    return chat_module.run(cfg, cfg.resolved_run_dir)


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_log_filter()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        print("recipes:", ", ".join(recipe_names()))
        for group in ("model", "method", "hardware", "data"):
            print(f"{group}:", ", ".join(group_choices(group)))
        return 0
    restore = interrupt_on_signals()
    try:
        if args and args[0] == "init":
            return starter.write(args[1:])
        cfg = compose(args)
        if cfg.mode == "ui":
            return ui_server.serve(cfg.ui)
        if cfg.mode == "chat":
            return chat(cfg)
        if cfg.smoke.enabled and cfg.mode in ("all", "train"):
            # a config file's group choices carried as the command line's are; its recipe is the run's own
            smoke.run(cfg, user_files(args)[0])
        return run(cfg)
    except FinetuneError as exc:
        print(f"finetune: error: {terminal_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # an OSError, or a library's own error that says so (safetensors')
        if not is_disk_full(exc):
            raise
        where = getattr(exc, "filename", None) or os.getcwd()
        print(
            f"finetune: error: {terminal_line(DiskFullError(where, None, free_bytes(Path(where))))}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as exc:
        name = getattr(exc, "signal_name", "SIGINT")
        print(
            f"finetune: stopped by {name} during {stages.current_stage}; what was written completely is kept "
            "(files, the data cache and checkpoints are written whole or not at all); run the same command "
            "again to continue",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE
    finally:
        restore()
