"""`python -m finetune init my.yaml`: a commented starter config file of the user's own.

    python -m finetune init my.yaml                                         # the tiny model, bundled data, CPU
    python -m finetune init my.yaml model=Qwen/Qwen2.5-0.5B-Instruct data.path=chats.jsonl hardware=rtx3090

The file has the recipes' schema (recipes/*.yaml); `python -m finetune my.yaml key=value ...` runs it with
overrides on top. What is written is composed once before it is kept, so a starter always runs as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from finetune.core.composition import compose
from finetune.core.errors import ConfigError

# What `init` fills in from its arguments, and the value when not given: a job that runs on any machine.
CHOICES = {"model": "tiny", "method": "lora", "hardware": "cpu", "data.path": None}

TEMPLATE = """\
# {name}: a fine-tuning job of your own (the same schema as the recipes in recipes/).
#   python -m finetune {path} mode=plan        # will it fit, and how will it run? (no GPU needed)
#   python -m finetune {path}                  # plan, prepare the data, train, evaluate, export
#   python -m finetune {path} train.seq_len=4096 name=longer   # any key overridden on top; name= keeps runs apart
#   python -m finetune {path} mode=chat        # talk to the trained model in the terminal

# A preset (configs/model/: llama3_1_8b, qwen3_8b, smollm2_135m, ...), a hub id (Qwen/Qwen2.5-7B-Instruct),
# or a local folder holding the model's config.json (/models/my-sft). See docs/models.md.
model: {model}

# lora (adapters on a frozen base), qlora (the base in 4 bits: the least memory) or full.
method: {method}

# cpu (this machine, no GPU), local (this machine's GPUs), auto (the cheapest profile that fits), a profile
# (configs/hardware/: rtx3090, rtx4090, l40s, h100, ...), or custom with your card's figures:
#   hardware: custom
#   hardware.gpu_memory_gb / peak_bf16_tflops / usd_per_gpu_hour as overrides. See docs/hardware.md.
hardware: {hardware}

data:
  # A .jsonl / .json / .csv / .parquet file, a folder of them, a save_to_disk folder, or a hub data set
  # (ORG/NAME, with split / subset / revision). null: the data set bundled with finetune. See docs/data.md.
  path: {data_path}
  format: auto          # auto | messages | prompt_completion | alpaca | text (plain text, every token trained)
  # prompt_field: question     # CSV or JSON columns named otherwise
  # completion_field: answer
  eval_fraction: 0.1    # held out to measure the loss and the answers before and after training

train:
  seq_len: 1024         # tokens a row; auto takes the longest sample after cleaning (once mode=data ran)
  epochs: 1
  # max_steps: 400      # a fixed number of optimizer steps instead of epochs
"""


def write(argv: Sequence[str]) -> int:
    """`init FILE [model=...] [method=...] [hardware=...] [data.path=...]`: write the starter, refusing to
    replace a file that exists."""
    if not argv or "=" in argv[0]:
        raise ConfigError("init: name the file to write (python -m finetune init my.yaml)")
    path = Path(argv[0])
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"init {path}: name a .yaml file")
    values = dict(CHOICES)
    for item in argv[1:]:
        key, sep, value = item.partition("=")
        if not sep or key not in CHOICES:
            raise ConfigError(f"init: {item}: give {', '.join(f'{k}=...' for k in CHOICES)}")
        values[key] = value
    if path.exists():
        raise ConfigError(f"init {path}: the file exists; choose another name or remove it first")
    text = TEMPLATE.format(
        name=path.stem,
        path=path,
        model=_yaml_scalar(values["model"]),
        method=_yaml_scalar(values["method"]),
        hardware=_yaml_scalar(values["hardware"]),
        data_path=_yaml_scalar(values["data.path"]),
    )
    staged = path.with_name(f".{path.stem}.init.yaml")
    staged.write_text(text, "utf-8")
    try:
        compose([str(staged), "mode=plan"])
    except ConfigError as exc:
        staged.unlink()
        raise ConfigError(f"init {path}: {str(exc).removeprefix(f'{staged}: ')}") from None
    staged.rename(path)
    print(f"wrote {path}: edit it, then python -m finetune {path} mode=plan")
    return 0


def _yaml_scalar(value: object) -> str:
    """A value as YAML writes it: null, a bare word, or a quoted string where YAML would misread it."""
    if value is None or value == "null":
        return "null"
    text = str(value)
    return text if re.fullmatch(r"[\w./~+-]+", text) and not text[0].isdigit() else json.dumps(text)
