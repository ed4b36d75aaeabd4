"""export/README.md: the Hub model card of what export/ holds, written from the run directory's own records.

The YAML front matter is what the Hub indexes (base_model, library_name, tags, license, datasets); the body
says the method, the data statistics (data_stats.json), the plan (plan.json), the evaluation
(eval/metrics.json), the files, and the command that reproduces the run: the overrides of the recipe or model
the run started from, checked to compose back into the run's own config (`reproduce_overrides`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import yaml

from finetune import rundir
from finetune.core.composition import compose, group_choices, recipe_names
from finetune.core.config import Config, ModelConfig
from finetune.core.markup import markdown_text
from finetune.core.nested import flatten
from finetune.modeling.models import model_source

# Keys a reproduction leaves to the machine it runs on (the hardware profile is chosen by name).
_MACHINE_SECTIONS = ("hardware",)
_SKIPPED = ("mode", "run_dir")


def _value(value: Any) -> str:
    """A value as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    text = str(value)
    if isinstance(value, str) and (text == "" or re.search(r"[\s,=\[\]{}()'\"\\:$]", text)):
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def _start(cfg: Config) -> list[str]:
    """What the run composed from: its recipe when one is named like it, else its model's group."""
    if cfg.name in recipe_names():
        return [f"+recipe={cfg.name}"]
    if cfg.model.name in group_choices("model"):
        return [f"model={cfg.model.name}"]
    return []


def reproduce_overrides(cfg: Config) -> list[str]:
    """The command-line overrides that compose the run's config again: its starting recipe or model, the
    hardware profile by name, and every other value that differs from what those give."""
    start = _start(cfg)
    if cfg.hardware.name in group_choices("hardware"):
        start.append(f"hardware={cfg.hardware.name}")
    mine, base = flatten(asdict(cfg)), flatten(asdict(compose(start)))
    changed = [
        f"{key}={_value(value)}"
        for key, value in mine.items()
        if key.split(".")[0] not in _MACHINE_SECTIONS
        and key not in _SKIPPED
        and base.get(key, object()) != value
    ]
    return [*start, *changed]


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        doc = json.loads(rundir.read_own_text(path))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def base_license(model: ModelConfig) -> Optional[str]:
    """The base model's license, from the front matter of its README.md: beside its local weights, or in the
    Hub cache for a Hub id (nothing is downloaded)."""
    source = model_source(model)
    readme: Optional[Path] = Path(source) / "README.md"
    if not Path(source).is_dir():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "README.md")
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None or not readme.is_file():
        return None
    match = re.match(r"---\n(.*?)\n---", readme.read_text(errors="replace"), re.S)
    if not match:
        return None
    try:
        front = yaml.safe_load(match.group(1)) or {}
    except yaml.YAMLError:
        return None
    value = front.get("license") if isinstance(front, dict) else None
    return str(value) if value else None


def front_matter(cfg: Config, license_name: Optional[str], summary: dict[str, Any]) -> dict[str, Any]:
    merged = "merged" in summary
    tags = ["finetune", cfg.method.name, cfg.objective.name, *(["gguf"] if "gguf" in summary else [])]
    meta: dict[str, Any] = {
        "base_model": cfg.model.hub_id or cfg.model.name,
        "library_name": "transformers" if merged else "peft",
        "tags": tags,
        "license": license_name or "other",
    }
    if cfg.data.path and "/" in cfg.data.path and not Path(cfg.data.path).exists():  # a Hub data set
        meta["datasets"] = [cfg.data.path]
    return meta


def render(cfg: Config, run_dir: Path, summary: dict[str, Any], license_name: Optional[str]) -> str:
    """The card's Markdown."""
    run_dir = Path(run_dir)
    meta = front_matter(cfg, license_name, summary)
    base = markdown_text(str(meta["base_model"]))
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).strip(),
        "---",
        "",
        f"# {markdown_text(cfg.name)}",
        "",
    ]
    lines += [
        f"{base} fine-tuned with {cfg.method.name} ({cfg.objective.name}) by finetune."
        + ("" if license_name else " The base model's license was not found beside its weights: check it."),
        "",
        "## Training data",
        "",
    ]
    stats = _read_json(run_dir / rundir.DATA_STATS_FILE)
    if stats:
        tokens = stats.get("tokens") or {}
        lines += [
            "| examples (train / held out) | tokens (train) | tokens per example (median / max) | sequence length |",
            "|---|---|---|---|",
            f"| {stats.get('num_train')} / {stats.get('num_eval')} | {tokens.get('train_total')} | "
            f"{tokens.get('p50')} / {tokens.get('max')} | {stats.get('seq_len', cfg.train.seq_len)} |",
        ]
    else:
        lines.append("No data statistics in the run (data_stats.json).")
    lines += ["", "## Plan", ""]
    plan = _read_json(run_dir / rundir.PLAN_FILE)
    if plan:
        strategy = plan.get("strategy") or {}
        hardware = (plan.get("hardware") or {}).get("name")
        lines += [
            f"- hardware: {markdown_text(str(hardware))}; GPU memory planned: "
            f"{(plan.get('gpu_memory_gb') or {}).get('total')} GB a GPU",
            f"- parameters: {(plan.get('params') or {}).get('total'):,} "
            f"({(plan.get('params') or {}).get('trainable'):,} trained)",
            "- strategy: " + ", ".join(f"{k}={markdown_text(str(v))}" for k, v in strategy.items()),
        ]
    lines += ["", "## Evaluation", ""]
    scores = _read_json(rundir.eval_dir(run_dir) / rundir.EVAL_METRICS_FILE) or {}
    variants = [v for v in ("base", "trained", "merged") if isinstance(scores.get(v), dict)]
    names = list(
        dict.fromkeys(
            k
            for v in variants
            for k, x in scores[v].items()
            if isinstance(x, (int, float)) and not isinstance(x, bool)
        )
    )
    if variants and names:
        lines += ["| model | " + " | ".join(markdown_text(n) for n in names) + " |"]
        lines += ["|---" * (len(names) + 1) + "|"]
        for v in variants:
            cells = [_cell(scores[v].get(n)) for n in names]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    else:
        lines.append("Not evaluated (run mode=eval).")
    lines += ["", "## Files", ""]
    if "merged" in summary:
        # what the objective trained (finetune/core/objectives.py): a policy, or a reward model's score head
        auto = (
            "AutoModelForSequenceClassification"
            if cfg.objective.spec.head == "score"
            else "AutoModelForCausalLM"
        )
        lines.append(
            f"- the merged model (safetensors), loadable with `{auto}.from_pretrained`: {cfg.objective.spec.export}"
        )
    if "adapter" in summary:
        lines.append(f"- `adapter/`: the {cfg.method.name} adapter alone (PEFT)")
    if "gguf" in summary:
        name = summary["gguf"]["path"]
        lines.append(
            f"- `gguf/{name}` ({summary['gguf']['type']}, llama.cpp) and `gguf/Modelfile`: "
            f"`ollama create {markdown_text(cfg.name)} -f gguf/Modelfile`"
        )
    command = rundir.command_line("python", "-m", "finetune", *reproduce_overrides(cfg))
    lines += ["", "## Reproduce", "", "```bash", command, "```", ""]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:.4f}"
