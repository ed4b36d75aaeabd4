"""The regression set: general prompts a fine-tune must not get worse at.

Each answer gets flags (`refusal`, `empty`, `check_failed`); a flag the
fine-tuned (or merged) model raises where the base did not is a regression.
The bundled set holds general prompts with checkable answers (facts,
arithmetic, following a format, other languages), each one SmolLM2-135M-Instruct
answers correctly before fine-tuning (BENCHMARKS.md), and benign prompts with
alarming words that must not be refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from finetune.core import userfiles
from finetune.core.errors import DataError
from finetune.core.package import PACKAGE_DIR

FLAGS = ("refusal", "empty", "check_failed")


def bundled_path() -> Path:
    return PACKAGE_DIR / "data" / "regression" / "prompts.jsonl"


def load(path: Optional[str] = None) -> list[dict]:
    """Rows {id, category, messages, check?} from `path` (None: the bundled set), validated."""
    file = Path(path) if path else bundled_path()
    lines = userfiles.read_text(file, "eval.regression_prompts", error=DataError).splitlines()
    rows, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages = row["messages"]
            rid = str(row.get("id") or f"regression-{n}")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{file}:{n}: not a regression prompt with 'messages' ({exc})") from None
        if not messages or messages[-1].get("role") == "assistant":
            raise DataError(f"{file}:{n}: 'messages' must end with the turn to answer, not an assistant turn")
        if rid in seen:
            raise DataError(f"{file}:{n}: duplicate id {rid!r}")
        check = (row.get("check") or {}).get("regex")
        if check is not None:
            try:
                re.compile(check)
            except re.error as exc:
                raise DataError(f"{file}:{n}: check.regex is invalid ({exc})") from None
        seen.add(rid)
        rows.append(
            {"id": rid, "category": row.get("category", "general"), "messages": messages, "check": check}
        )
    return rows


def flags(answer: str, check: Optional[str], refusal_pattern: str) -> list[str]:
    """What is wrong with one answer: refusal, empty, check_failed."""
    out = []
    if re.search(refusal_pattern, answer):
        out.append("refusal")
    if not answer.strip():
        out.append("empty")
    if check is not None and not re.search(check, answer.strip()):
        out.append("check_failed")
    return out


def summary(rows: Sequence[dict[str, Any]], variant: str) -> dict[str, Any]:
    """Counts for one model over the regression rows of samples.jsonl (each with `flags` per model).

    `regression_checks_kept` (not for the base): of the checks the base passes, the share this model passes
    too, the number the fine-tune must hold up (a check the base fails says nothing about forgetting).
    Where the base was scored and passes none of the checks (a random-init model, the embedded `tiny`), the
    set measures nothing for this model: both shares are None, and `regression_note` says so in words
    (0.0 would read as a result).
    """
    checked = [r for r in rows if r.get("check")]
    own = [r["flags"].get(variant, []) for r in rows]
    passed = sum("check_failed" not in r["flags"].get(variant, []) for r in checked)
    base_passed = [r for r in checked if "check_failed" not in r["flags"].get("base", ["check_failed"])]
    out: dict[str, Any] = {
        "regression_refusals": sum("refusal" in f for f in own),
        "regression_empty": sum("empty" in f for f in own),
        "regression_checks_passed": round(passed / len(checked), 4) if checked else None,
    }
    if variant != "base":
        kept = sum("check_failed" not in r["flags"].get(variant, ["check_failed"]) for r in base_passed)
        out["regression_checks_kept"] = round(kept / len(base_passed), 4) if base_passed else None
    base_scored = all("base" in r["flags"] for r in checked)
    if checked and base_scored and not base_passed:
        out["regression_checks_passed"] = None
        out["regression_note"] = nothing_measured(len(checked))
    return out


def nothing_measured(n_checks: int) -> str:
    """What the regression set says about a model whose base passes none of its `n_checks` checks."""
    return f"regression set: the base passes 0 of {n_checks} checks, so it measures nothing for this model"


def note(scores: dict[str, Any]) -> Optional[str]:
    """The `regression_note` of the models in `scores` ({variant: their scores, ...}), which share one base."""
    return next(
        (m["regression_note"] for m in scores.values() if isinstance(m, dict) and m.get("regression_note")),
        None,
    )


def regressions(rows: Sequence[dict[str, Any]], variant: str) -> dict[str, list[str]]:
    """Prompt ids where `variant` raises a flag the base did not: {new_refusals, new_empty, lost_checks}."""
    out: dict[str, list[str]] = {"new_refusals": [], "new_empty": [], "lost_checks": []}
    names = {"refusal": "new_refusals", "empty": "new_empty", "check_failed": "lost_checks"}
    for row in rows:
        base, mine = row["flags"].get("base"), row["flags"].get(variant)
        if base is None or mine is None:
            continue
        for flag in FLAGS:
            if flag in mine and flag not in base:
                out[names[flag]].append(row["id"])
    return out


# The share of the base's passed checks a fine-tuned model still passes (`summary`).
KEPT_METRIC = "regression_checks_kept"


def lost_checks(result: dict[str, Any]) -> dict[str, list[str]]:
    """{variant: the regression prompts whose check the base passes and it fails} from eval/metrics.json's
    `regression`, for the variants that lost any."""
    found = result.get("regression") or {}
    return {
        v: list(f["lost_checks"]) for v, f in found.items() if isinstance(f, dict) and f.get("lost_checks")
    }


def lost_line(variant: str, ids: Sequence[str]) -> str:
    """One line on the checks `variant` lost: how many, the first few prompt ids, where to read them."""
    shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
    return (
        f"{variant} fails {len(ids)} regression check{'s' if len(ids) != 1 else ''} the base passes ({shown}); "
        "its answers are in eval/report.md and eval/samples.jsonl"
    )
