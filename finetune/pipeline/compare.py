"""mode=compare: several runs' metrics side by side, so a sweep reads at a glance.

    python -m finetune mode=compare runs=[runs/lr1e-4,runs/lr3e-4,runs/lr1e-3]

A run is a run directory, or a name under `runs/`. Rows: the config keys whose
values differ between the runs (the sweep's knobs), the training summary, and
every metric of eval/metrics.json for base, trained and merged (the training
stage's metrics.json `eval` when evaluation has not run). The best value of each
metric row is marked. Printed with rich, written to compare.md and compare.json.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import RUNS_DIR
from finetune.core.errors import ConfigError, FinetuneError
from finetune.core.markup import console_text, markdown_cell
from finetune.core.nested import flatten
from finetune.modeling.variants import VARIANTS

# Config keys that differ between any two runs without being a knob of the experiment.
IGNORED_KEYS = ("run_dir", "mode", "runs", "plan.out", "resume", "name", "data.cache_dir")
TRAIN_KEYS = ("steps", "final_loss", "tokens_per_second", "peak_memory_gb", "train_seconds", "stopped_early")
LOWER_IS_BETTER = (
    "loss",
    "final_loss",
    "peak_memory_gb",
    "train_seconds",
    "regression_refusals",
    "regression_empty",
)


def resolve_run(name: str, root: Path = Path(RUNS_DIR)) -> Path:
    for path in (Path(name), root / name):
        if path.is_dir():
            return path
    raise ConfigError(f"runs: {name!r} is not a run directory (looked in {name} and {root / name})")


def _read(file: Path, parse: Any) -> Any:
    """A compared run's file, parsed; a damaged one is one line naming it (a link or FIFO there too)."""
    if not file.is_file():
        return {}
    try:
        doc = parse(rundir.read_own_text(file))
    except FinetuneError:
        raise
    except Exception as exc:
        # JSON's and YAML's errors: the file is not what finetune writes.
        raise ConfigError(f"runs: {file} is damaged ({type(exc).__name__}); run its stage again") from None
    return doc if isinstance(doc, dict) else {}


def _config(path: Path) -> dict[str, Any]:
    import yaml

    return flatten(_read(path / rundir.CONFIG_FILE, yaml.safe_load))


def _metrics(path: Path) -> tuple[dict[str, dict], dict[str, Any], str]:
    """({variant: metrics}, training summary, source file) of one run."""
    evaluation = rundir.eval_dir(path) / rundir.EVAL_METRICS_FILE
    train_doc = _read(path / rundir.METRICS_FILE, json.loads)
    if evaluation.is_file():
        doc, source = _read(evaluation, json.loads), f"{rundir.EVAL_DIR}/{rundir.EVAL_METRICS_FILE}"
    else:
        doc, source = train_doc.get("eval", {}), rundir.METRICS_FILE
    doc = doc if isinstance(doc, dict) else {}
    variants = {v: doc[v] for v in VARIANTS if isinstance(doc.get(v), dict)}
    train = train_doc.get("train", {})
    return variants, train if isinstance(train, dict) else {}, source


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def collect(run_dirs: Sequence[Path]) -> dict[str, Any]:
    """The comparison as data: runs (name, path, source) and rows {key, kind, values[], best}."""
    if not run_dirs:
        raise ConfigError("runs: name at least one run directory (runs=[runs/a,runs/b])")
    configs = [_config(p) for p in run_dirs]
    loaded = [_metrics(p) for p in run_dirs]
    if not any(variants or train for variants, train, _ in loaded):
        raise ConfigError("runs: none of these runs has metrics yet (run mode=train or mode=eval first)")
    rows: list[dict[str, Any]] = []

    keys = sorted({k for c in configs for k in c})
    for key in keys:
        if key in IGNORED_KEYS or key.startswith(IGNORED_KEYS):
            continue
        values = [c.get(key) for c in configs]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            rows.append({"key": key, "kind": "config", "values": values})

    for key in TRAIN_KEYS:
        values = [train.get(key) for _, train, _ in loaded]
        if any(v is not None for v in values):
            rows.append({"key": f"train.{key}", "kind": "train", "values": values})

    for variant in VARIANTS:
        names: list[str] = []
        for variants, _, _ in loaded:
            for k, v in variants.get(variant, {}).items():
                if k not in names and (_is_number(v) or v is None) and k != "generated":
                    names.append(k)
        names.sort(key=lambda k: k != "loss")
        for name in names:
            values = [variants.get(variant, {}).get(name) for variants, _, _ in loaded]
            rows.append({"key": f"{variant}.{name}", "kind": "metric", "values": values})

    for row in rows:
        numbers = [(v, i) for i, v in enumerate(row["values"]) if _is_number(v)]
        row["best"] = None
        if row["kind"] != "config" and len(numbers) > 1 and len({v for v, _ in numbers}) > 1:
            leaf = row["key"].rsplit(".", 1)[-1]
            pick = min if leaf in LOWER_IS_BETTER else max
            row["best"] = pick(numbers)[1]
    return {
        "runs": [
            {"name": p.name, "path": str(p), "source": source} for p, (_, _, source) in zip(run_dirs, loaded)
        ],
        "rows": rows,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def markdown(table: dict[str, Any]) -> str:
    """compare.md: run names, keys and values are user text, escaped (`markup.markdown_cell`)."""
    names = [markdown_cell(r["name"]) for r in table["runs"]]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in table["rows"]:
        cells = [markdown_cell(_fmt(v)) for v in row["values"]]
        if row["best"] is not None:
            cells[row["best"]] = f"**{cells[row['best']]}**"
        lines.append(f"| {markdown_cell(row['key'])} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Bold: the best value of a row (lowest loss, memory and time; highest task scores).")
    return "\n".join(lines) + "\n"


def print_table(table: dict[str, Any], console: Optional[Any] = None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="runs compared", header_style="bold")
    t.add_column("")
    for r in table["runs"]:
        t.add_column(console_text(r["name"]), justify="right")
    section = None
    for row in table["rows"]:
        if section is not None and row["kind"] != section:
            t.add_section()
        section = row["kind"]
        cells = [console_text(_fmt(v)) for v in row["values"]]
        if row["best"] is not None:
            cells[row["best"]] = f"[bold green]{cells[row['best']]}[/bold green]"
        t.add_row(console_text(row["key"]), *cells)
    (console or Console()).print(t)


def run(runs: Sequence[str], out_dir: Path, console: Optional[Any] = None) -> dict[str, Any]:
    """Compare `runs` (directories or names under runs/), print the table, write compare.{md,json} to `out_dir`."""
    table = collect([resolve_run(r) for r in runs])
    print_table(table, console)
    out_dir = Path(out_dir)
    rundir.write_json(out_dir / rundir.COMPARE_JSON_FILE, table)
    rundir.atomic_write_text(out_dir / rundir.COMPARE_MD_FILE, markdown(table))
    return table
