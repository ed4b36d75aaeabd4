"""`smoke=true`: the recipe's pipeline on its small sibling first, so a broken job fails in minutes.

    python -m finetune +recipe=llama70b_qlora smoke=true              # 8B sibling, 200 steps, then the 70B run
    python -m finetune +recipe=llama70b_qlora smoke=true smoke.steps=50

The sibling (`smoke.sibling`, named by each recipe) runs the same stages
with the longest sample in the first batch (the data stage packs it there):
train `smoke.steps` steps with a checkpoint half way, resume from the last
checkpoint for two more steps, merge and check the merge. `tiny` stands in
where the model hub cannot be reached. Every check lands in
RUN_DIR/smoke/smoke_report.json; a failed check stops the real run.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune import rundir
from finetune.core.composition import compose
from finetune.core.config import Config
from finetune.core.errors import FinetuneError, LaunchError
from finetune.core.markup import terminal_text
from finetune.data.stage import load_prepared
from finetune.pipeline import stages

RESUME_EXTRA_STEPS = 2

# Overrides that belong to the real run only: the sibling recipe sets its own.
_NOT_CARRIED = re.compile(
    r"\+*(recipe|smoke|model|name|run_dir|mode|resume|runs|train\.(max_steps|save_steps|epochs))([.=])"
)
_HARDWARE = re.compile(r"\+*hardware([.=])")


def hub_reachable(host: str = "huggingface.co", port: int = 443, timeout: float = 3.0) -> bool:
    """Can this machine reach the model hub? (Offline mode counts as no.)"""
    import os

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def sibling_overrides(cfg: Config, overrides: Sequence[str], sibling: str) -> list[str]:
    """The command line of the smoke run: the sibling recipe, the user's other settings, a short run."""
    steps = cfg.smoke.steps
    carried = [o for o in overrides if not _NOT_CARRIED.match(o)]
    if sibling == "tiny":
        carried = [o for o in carried if not _HARDWARE.match(o)]  # tiny runs on the CPU profile
    return [
        f"+recipe={sibling}",
        *carried,
        f"run_dir={cfg.resolved_run_dir / rundir.SMOKE_DIR}",
        "mode=all",
        "resume=false",
        f"train.max_steps={steps}",
        f"train.save_steps={max(1, steps // 2)}",
        "eval.num_samples=32",
        "eval.regression=false",
    ]


def _check(report: list[dict[str, Any]], name: str, ok: bool, detail: str) -> None:
    report.append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"smoke: {'ok  ' if ok else 'FAIL'} {name}: {terminal_text(detail)}")


def run(cfg: Config, overrides: Sequence[str], hub_check: Any = hub_reachable) -> dict[str, Any]:
    """Run the smoke pipeline; raise LaunchError (exit 2) if any check fails, so the real run never starts."""
    sibling = cfg.smoke.sibling or "tiny"
    notes: list[str] = []
    if sibling != "tiny":
        probe = compose([f"+recipe={sibling}", "mode=plan"])
        if probe.model.hub_id and not hub_check():
            notes.append(f"model hub unreachable: tiny stands in for {sibling}")
            sibling = "tiny"
    for note in notes:
        print(f"smoke: {note}")
    smoke_overrides = sibling_overrides(cfg, overrides, sibling)
    smoke_cfg = compose(smoke_overrides)
    smoke_dir = smoke_cfg.resolved_run_dir
    print(f"smoke: {sibling} for {cfg.smoke.steps} steps in {smoke_dir}")
    report: list[dict[str, Any]] = []
    steps = cfg.smoke.steps
    try:
        stages.run(smoke_cfg)
        metrics = json.loads((smoke_dir / rundir.METRICS_FILE).read_text())["train"]
        _check(
            report,
            "train",
            metrics["steps"] == steps,
            f"{metrics['steps']} steps, final loss {metrics['final_loss']}",
        )
        first = _first_batch_has_longest(smoke_dir)
        _check(report, "longest sample first", first[0], first[1])
        _check(
            report,
            "memory within plan",
            not metrics.get("memory_over_plan", False),
            f"peak {metrics['peak_memory_gb']:.2f} GB, planned {metrics['planned_memory_gb']:.2f} GB",
        )
        checkpoint = rundir.checkpoint_dir(smoke_dir) / f"checkpoint-{steps}"
        _check(report, "save", checkpoint.is_dir(), str(checkpoint))
        # Read before the resumed run: training a new model moves this export aside (superseded-export/).
        merge = json.loads((rundir.export_dir(smoke_dir) / rundir.MERGE_CHECK_FILE).read_text())
        _check(report, "merge", merge["ok"], f"max |logit diff| {merge['max_abs_diff']:.3g}")
        # Later overrides win: the same smoke run, resumed for two more steps.
        resumed_cfg = compose(
            [*smoke_overrides, "mode=train", "resume=true", f"train.max_steps={steps + RESUME_EXTRA_STEPS}"]
        )
        stages.run(resumed_cfg)
        resumed = json.loads((smoke_dir / rundir.METRICS_FILE).read_text())["train"]
        ok = resumed["steps"] == steps + RESUME_EXTRA_STEPS and str(resumed.get("resumed_from", "")).endswith(
            f"checkpoint-{steps}"
        )
        _check(report, "resume", ok, f"resumed from {resumed.get('resumed_from')} to step {resumed['steps']}")
    except FinetuneError as exc:
        _check(report, "pipeline", False, str(exc))
    except (OSError, KeyError, json.JSONDecodeError) as exc:
        _check(report, "pipeline", False, f"{type(exc).__name__}: {exc}")
    result = {
        "sibling": sibling,
        "steps": steps,
        "notes": notes,
        "checks": report,
        "ok": all(c["ok"] for c in report),
    }
    smoke_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(smoke_dir / rundir.SMOKE_REPORT_FILE, result)
    if not result["ok"]:
        failed = ", ".join(c["check"] for c in report if not c["ok"])
        raise LaunchError(
            f"smoke run failed ({failed}; see {smoke_dir / rundir.SMOKE_REPORT_FILE}): the real run was not launched"
        )
    print(f"smoke: all {len(report)} checks passed; starting the real run")
    return result


def _first_batch_has_longest(run_dir: Path) -> tuple[bool, str]:
    train, _ = load_prepared(run_dir)
    longest = max(max(row) for row in train["seq_lengths"])
    first = max(train[0]["seq_lengths"])
    return first == longest, f"longest sample {longest} tokens, first row's longest {first}"
