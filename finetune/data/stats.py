"""Token statistics per split and the length histogram."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Optional


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile (a length that occurs in the data, never an interpolated one)."""
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return int(sorted_values[min(rank, len(sorted_values)) - 1])


def summary(lengths: Sequence[int]) -> dict:
    s = sorted(lengths)
    return {
        "count": len(s),
        "total": int(sum(s)),
        "min": int(s[0]) if s else 0,
        "p50": percentile(s, 50),
        "p95": percentile(s, 95),
        "p99": percentile(s, 99),
        "max": int(s[-1]) if s else 0,
    }


def histogram(path: Path, splits: dict[str, Sequence[int]], seq_len: Optional[int]) -> None:
    """A PNG of sample lengths per split, with the sequence length marked."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    top = max((int(np.max(v)) for v in splits.values() if len(v)), default=1)
    bins = min(60, max(5, top))
    for name, values in splits.items():
        if len(values):
            # Counted first (np.histogram, what ax.hist runs) and drawn from the counts, as matplotlib's docs
            # show for pre-binned data: the same bars, and only the bins held, not a float per sample.
            counts, edges = np.histogram(np.asarray(values), bins=bins, range=(0, top))
            ax.hist(edges[:-1], edges.tolist(), weights=counts, alpha=0.6, label=f"{name} ({len(values)})")
    if seq_len:
        ax.axvline(seq_len, color="black", linestyle="--", linewidth=1, label=f"seq_len {seq_len}")
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.set_title("Sample lengths")
    # A fixed corner: loc="best" searches the bars and warns (an error under pytest's -W error) when that
    # takes over a second, as it did with a busy CPU (test_data_stage failed on it).
    ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
