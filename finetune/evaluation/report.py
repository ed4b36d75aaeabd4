"""eval/report.md: the metrics side by side, what regressed, a few examples, the loss curves.

Every prompt, answer, reference and name in it is escaped (`finetune.core.markup`): a report opened in a
Markdown viewer shows the text, never runs HTML from the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune import rundir
from finetune.core.config import Config
from finetune.core.markup import markdown_cell, markdown_text
from finetune.evaluation import regression
from finetune.modeling.outputs import Identity
from finetune.modeling.variants import VARIANTS
from finetune.rundir import checkpoints

# Metrics where lower is better; every other one is better higher.
LOWER_IS_BETTER = ("loss", "regression_refusals", "regression_empty")


def metric_names(result: dict[str, Any]) -> list[str]:
    """Numeric metric names over the evaluated models, loss first, in first-seen order."""
    names: list[str] = []
    for v in VARIANTS:
        for k, value in result.get(v, {}).items():
            if k not in names and (isinstance(value, (int, float)) or value is None):
                names.append(k)
    return sorted(names, key=lambda k: (k != "loss", k == "generated"))


def _cell(value: Any, width: int = 80) -> str:
    """A table cell: numbers as numbers, any text (prompts, answers, names) escaped (`markup.markdown_cell`)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return markdown_cell(value, width)


def _delta(name: str, base: Any, other: Any) -> str:
    """other − base, marked ✓ where the model got better and ✗ where it got worse."""
    if not isinstance(base, (int, float)) or not isinstance(other, (int, float)):
        return "-"
    d = other - base
    better = d < 0 if name in LOWER_IS_BETTER else d > 0
    mark = " ✓" if better else (" ✗" if d else "")
    return (f"{d:+d}" if isinstance(d, int) else f"{d:+.4f}") + mark


def models_section(result: dict[str, Any]) -> list[str]:
    """Which model each column is (metrics.json `models`), and what was not scored (`skipped`)."""
    models, skipped = result.get("models") or {}, result.get("skipped") or {}
    if not models and not skipped:
        return []
    lines = ["## Models", ""]
    for v in VARIANTS:
        record = models.get(v)
        if v in skipped:
            lines.append(
                f"- **{v}**: not scored: {markdown_text(skipped[v])}; run mode=export to export the trained model."
            )
        elif v == "base" and record:
            lines.append(
                f"- **base**: {markdown_text(record.get('model'))} ({markdown_text(record.get('source'))})"
            )
        elif v == "trained" and (identity := Identity.from_dict(record)):
            lines.append(
                f"- **trained**: {markdown_text(identity.describe())}, saved "
                f"{markdown_text(identity.saved or 'at an unknown time')}"
            )
        elif v == "merged" and record:
            source = Identity.from_dict(record.get("made_from"))
            made = (
                f"made from {markdown_text(source.describe())}" if source else "made from an unrecorded model"
            )
            trained = Identity.from_dict(models.get("trained"))
            same = (
                " (the trained model above)" if source and trained and source.sha256 == trained.sha256 else ""
            )
            lines.append(f"- **merged**: {markdown_text(record.get('path'))}, {made}{same}")
    return lines


def write_report(
    cfg: Config, path: Path, result: dict[str, Any], rows: Sequence[dict], curves_drawn: bool
) -> None:
    e = cfg.eval
    variants = [v for v in VARIANTS if v in result]
    decoding = (
        "greedy" if e.greedy else f"sampling (temperature {e.temperature}, top_p {e.top_p}, seed {e.seed})"
    )
    lines = [
        f"# Evaluation: {markdown_text(cfg.name)}",
        "",
        f"{markdown_text(cfg.method.name)} on {markdown_text(cfg.model.name)}. Every model answers the same "
        "prompts with the same chat "
        f"template and decoding: {decoding}, at most {e.max_new_tokens} new tokens. "
        "Loss: mean next-token loss over the labelled tokens of the held-out split.",
        "",
    ]
    header = ["metric", *variants] + [f"{v} − base" for v in variants if v != "base" and "base" in result]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lost = regression.lost_checks(result)
    for name in metric_names(result):  # eval.metrics names a regex or a function: user text
        cells = [_cell(name)] + [
            _cell(result[v].get(name)) + (" ✗" if name == regression.KEPT_METRIC and lost.get(v) else "")
            for v in variants
        ]
        if "base" in result:
            cells += [
                _delta(name, result["base"].get(name), result[v].get(name)) for v in variants if v != "base"
            ]
        lines.append("| " + " | ".join(cells) + " |")

    said = regression.note(result)
    if said:  # the regression shares are "-": say why, under the numbers
        lines += ["", f"{markdown_text(said[0].upper() + said[1:])}."]
    for v, ids in lost.items():
        lines += ["", f"**Warning**: {markdown_text(regression.lost_line(v, ids))}."]
    models = models_section(result)
    if models:
        lines += ["", *models]
    regressions = result.get("regression") or {}
    if regressions:
        lines += ["", "## Regression set", ""]
        n = sum(r["set"] == "regression" for r in rows)
        lines.append(f"{n} general prompts (instruction following, other languages, prompts not to refuse).")
        if said:
            lines.append(
                "The base passes none of their checks, so a failed check below says nothing about forgetting."
            )
        lines.append("")
        for v, found in regressions.items():
            problems = {k: ids for k, ids in found.items() if ids}
            if not problems:
                lines.append(
                    f"- **{v}**: nothing the base did better (no new refusals, empty answers or failed checks)."
                )
            else:
                text = "; ".join(
                    f"{markdown_text(k.replace('_', ' '))}: {markdown_text(', '.join(map(str, ids)))}"
                    for k, ids in problems.items()
                )
                lines.append(f"- **{v}**: {text}")

    lines += ["", "## Loss curves", ""]
    lines.append(
        f"![training and eval loss]({rundir.EVAL_CURVES_FILE})"
        if curves_drawn
        else f"No log history found ({rundir.CHECKPOINT_DIR}/*/{checkpoints.TRAINER_STATE_FILE} or "
        f"{rundir.TRAIN_LOG_FILE})."
    )

    task_rows = [r for r in rows if r["set"] == "task"][: e.report_examples]
    reg_rows = [r for r in rows if r["set"] == "regression"][: e.report_examples]
    for title, chosen, ref in (
        ("Held-out examples", task_rows, True),
        ("Regression examples", reg_rows, False),
    ):
        if not chosen:
            continue
        cols = ["prompt"] + (["reference"] if ref else []) + [v for v in variants]
        lines += ["", f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in chosen:
            lines.append("| " + " | ".join(_cell(r.get(c), 60) for c in cols) + " |")
    lines += ["", "All answers: `samples.jsonl`; numbers: `metrics.json`.", ""]
    rundir.atomic_write_text(path, "\n".join(lines))
