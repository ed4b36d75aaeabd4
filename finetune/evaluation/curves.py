"""Training and eval loss curves from the trainer's log history, drawn to a PNG.

The history comes from the newest `RUN_DIR/checkpoints/checkpoint-*/trainer_state.json`
and, when present, `RUN_DIR/train_log.jsonl` (one logged dict a line, with `step`),
which also covers steps after the last checkpoint; entries are merged by step.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Optional

from finetune import rundir
from finetune.core.markup import plot_text
from finetune.rundir import checkpoints


def _last_checkpoint_state(run_dir: Path) -> Optional[Path]:
    folder = rundir.checkpoint_dir(run_dir)
    if not folder.is_dir():
        return None
    states = []
    for path in folder.glob(f"checkpoint-*/{checkpoints.TRAINER_STATE_FILE}"):
        m = re.fullmatch(r"checkpoint-(\d+)", path.parent.name)
        if m:
            states.append((int(m.group(1)), path))
    return max(states)[1] if states else None


def log_history(run_dir: Path) -> list[dict]:
    """Logged dicts with a `step`, sorted by step (trainer_state.json and train_log.jsonl merged)."""
    entries: list[dict] = []
    state = _last_checkpoint_state(run_dir)
    if state is not None:
        entries += json.loads(state.read_text()).get("log_history", [])
    log = run_dir / rundir.TRAIN_LOG_FILE
    if log.is_file():
        for line in log.read_text().splitlines():
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
    merged: dict[tuple[int, str], dict] = {}
    for e in entries:
        if "step" not in e:
            continue
        kind = "eval" if "eval_loss" in e else "train" if "loss" in e else "other"
        merged.setdefault((int(e["step"]), kind), {}).update(e)
    return [merged[k] for k in sorted(merged)]


def loss_series(history: list[dict]) -> dict[str, list[tuple[int, float]]]:
    return {
        "train": [(int(e["step"]), float(e["loss"])) for e in history if "loss" in e],
        "eval": [(int(e["step"]), float(e["eval_loss"])) for e in history if "eval_loss" in e],
    }


def plot(run_dir: Path, out: Path, reference: Optional[dict[str, float]] = None) -> Optional[dict]:
    """Write the PNG; `reference` adds horizontal lines (e.g. base and trained held-out loss).

    Returns the number of points per series, or None when there is no log history to draw.
    """
    series = loss_series(log_history(run_dir))
    if not series["train"] and not series["eval"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    try:
        if series["train"]:
            ax.plot(*zip(*series["train"]), label="training loss", linewidth=1.2)
        if series["eval"]:
            ax.plot(*zip(*series["eval"]), "o-", label="eval loss", linewidth=1.2, markersize=4)
        for i, (name, value) in enumerate((reference or {}).items()):
            if value is not None:
                ax.axhline(value, linestyle="--", linewidth=0.8, color=f"C{i + 2}", label=plot_text(name))
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / token)")
        ax.set_title(f"{plot_text(run_dir.name)}: loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
        rundir.atomic_write_bytes(out, png.getvalue())
    finally:
        plt.close(fig)
    return {k: len(v) for k, v in series.items()}
