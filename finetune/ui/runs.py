"""The runs pages' data: the run directories under the runs folder, read-only.

A run is named by its folder's name alone: a name that is not one plain folder directly under the runs
folder (`..`, a path, a link leading elsewhere) is refused, so no address reads outside it. Files are
read as finetune wrote them (`rundir.read_own_text`: no links, no FIFOs); a damaged one is left out of
the page rather than failing it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.errors import ConfigError, FinetuneError
from finetune.evaluation.curves import log_history, loss_series
from finetune.modeling.variants import VARIANTS
from finetune.planner import Plan

# The samples a run page shows at most.
MAX_SAMPLES = 50
# What a run's folder name may be (finetune names them after the run: `core.config.Config.name`).
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")
# The files that make a folder a run directory.
_RUN_FILES = (rundir.PLAN_FILE, rundir.CONFIG_FILE, rundir.METRICS_FILE)


@dataclass(frozen=True)
class RunView:
    """What the pages show of one run."""

    name: str
    model: str = "-"
    method: str = "-"
    hardware: str = "-"
    plan: Optional[Plan] = None
    planned_gb: Optional[float] = None
    peak_gb: Optional[float] = None
    compared_gb: Optional[float] = None
    peak_source: Optional[str] = None
    steps: Optional[int] = None
    final_loss: Optional[float] = None
    loss: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    scores: dict[str, dict[str, Any]] = field(default_factory=dict)
    scores_source: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    samples_total: int = 0


def run_dir(root: Path, name: str) -> Path:
    """The run directory `name` under `root`; ConfigError for anything that is not a plain folder directly there."""
    path = root / name
    if (
        not _RUN_NAME.fullmatch(name)
        or path.is_symlink()
        or not path.is_dir()
        or path.resolve().parent != root.resolve()
        or not any((path / f).is_file() for f in _RUN_FILES)
    ):
        raise ConfigError(f"{name[:80]!r} is not a run directory under {root}")
    return path


def names(root: Path) -> list[str]:
    """The run directories under `root`, newest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        try:
            run_dir(root, path.name)
        except ConfigError:
            continue
        found.append((path.stat().st_mtime, path.name))
    return [name for _, name in sorted(found, reverse=True)]


def _json(path: Path) -> Any:
    try:
        return json.loads(rundir.read_own_text(path))
    except (OSError, ValueError, FinetuneError):
        return None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _config(path: Path) -> dict[str, Any]:
    import yaml

    try:
        return _dict(yaml.safe_load(rundir.read_own_text(path / rundir.CONFIG_FILE)))
    except (OSError, ValueError, yaml.YAMLError, FinetuneError):
        return {}


def _plan(path: Path) -> Optional[Plan]:
    doc = _json(path / rundir.PLAN_FILE)
    try:
        return Plan.from_dict(doc) if isinstance(doc, dict) else None
    except (FinetuneError, KeyError, TypeError, ValueError):
        return None


def summary(root: Path, name: str) -> RunView:
    """The facts of the runs list: names, the plan's total and the measured peak, the final loss."""
    path = run_dir(root, name)
    cfg, plan = _config(path), _plan(path)
    train = _dict(_dict(_json(path / rundir.METRICS_FILE)).get("train"))
    steps = train.get("steps")
    return RunView(
        name=name,
        model=str(_dict(cfg.get("model")).get("name", "-")),
        method=str(_dict(cfg.get("method")).get("name", "-")),
        hardware=plan.hardware.name if plan else str(_dict(cfg.get("hardware")).get("name", "-")),
        plan=plan,
        planned_gb=plan.gpu_memory.total if plan else _number(train.get("planned_memory_gb")),
        peak_gb=_number(train.get("peak_memory_gb")),
        compared_gb=_number(train.get("compared_memory_gb")),
        peak_source=train.get("peak_memory_source")
        if isinstance(train.get("peak_memory_source"), str)
        else None,
        steps=steps if isinstance(steps, int) else None,
        final_loss=_number(train.get("final_loss")),
    )


def detail(root: Path, name: str) -> RunView:
    """One run's page: the summary, its loss curve, its evaluation table and its first samples."""
    view = summary(root, name)
    path = run_dir(root, name)
    try:
        loss = loss_series(log_history(path))
    except (OSError, ValueError, TypeError, KeyError):
        loss = {}
    evaluated = path / rundir.EVAL_DIR / rundir.EVAL_METRICS_FILE
    if evaluated.is_file():
        doc, source = _dict(_json(evaluated)), f"{rundir.EVAL_DIR}/{rundir.EVAL_METRICS_FILE}"
    else:
        doc, source = _dict(_dict(_json(path / rundir.METRICS_FILE)).get("eval")), rundir.METRICS_FILE
    scores = {
        v: {k: s for k, s in doc[v].items() if isinstance(s, (int, float, str)) or s is None}
        for v in VARIANTS
        if isinstance(doc.get(v), dict)
    }
    samples, total = _samples(path / rundir.EVAL_DIR / rundir.EVAL_SAMPLES_FILE)
    return replace(
        view,
        loss=loss,
        scores=scores,
        scores_source=source if scores else "",
        samples=samples,
        samples_total=total,
    )


def _samples(path: Path) -> tuple[list[dict[str, Any]], int]:
    try:
        lines = rundir.read_own_text(path).splitlines()
    except (OSError, ValueError, FinetuneError):
        return [], 0
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows[:MAX_SAMPLES], len(rows)
