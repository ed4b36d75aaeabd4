"""The libraries' own console noise, quiet unless `verbose=true`.

What finetune prints (the plan, rich's progress bars, the evaluation table, one-line errors) says what a
user needs; the libraries under it add lines that repeat it or say nothing actionable here: DeepSpeed's
"Setting accelerator to CPU" in every process that imports it, bitsandbytes' note on an optional CPU
kernel package, and the tqdm bars of datasets, transformers and the hub, which interleave with rich's.
Their warnings and errors still show; `verbose=true` leaves every library as it is.
"""

from __future__ import annotations

import logging
import os
import sys

# Loggers whose INFO and WARNING lines are noise in a finetune run (their errors still show).
QUIET_LOGGERS = ("bitsandbytes",)
# DeepSpeed logs through one logger that sets its own level on import: its lines are filtered instead.
DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_NOISE = ("Setting accelerator to CPU", "Setting ds_accelerator to")
# The switches the libraries read for their tqdm bars (read when each one first draws).
PROGRESS_BAR_SWITCHES = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _not_noise(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or not any(n in record.getMessage() for n in DEEPSPEED_NOISE)


def quiet_libraries(verbose: bool) -> None:
    """Quiet the libraries' repeated notices and tqdm bars in this process and the ones it starts (the ranks
    inherit the environment); nothing changes under `verbose`. Idempotent."""
    if verbose:
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    deepspeed = logging.getLogger(DEEPSPEED_LOGGER)
    if _not_noise not in deepspeed.filters:
        deepspeed.addFilter(_not_noise)
    for key, value in PROGRESS_BAR_SWITCHES.items():
        os.environ.setdefault(key, value)
    # a library imported already has read its switch: its own call turns the bars off
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
