"""Best-fit-decreasing packing of whole samples into bins of `seq_len` tokens.

Samples are never split (a conversation keeps its structure); each bin keeps
the lengths of its samples so position ids restart at every sample and a
padding-free attention backend keeps samples apart. The bin holding the
longest sample comes first, so that a memory problem shows at step one; the
other bins follow in a seeded random order (BFD makes bins in decreasing
size order, which would otherwise correlate step and sequence shape).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from typing import Any


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose totals are <= capacity (each length must be <= capacity)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    # Open bins keyed by remaining room: a sorted list of distinct rooms, and the bins having each room.
    rooms: list[int] = []
    by_room: dict[int, list[int]] = {}
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"sample of {n} tokens does not fit in a bin of {capacity}")
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            b = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        else:
            room = capacity
            b = len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            if left not in by_room:
                bisect.insort(rooms, left)
                by_room[left] = []
            by_room[left].append(b)
    return bins


def order_bins(bins: list[list[int]], lengths: Sequence[int], seed: int) -> list[list[int]]:
    """The bin with the longest sample first, the others shuffled by seed."""
    if not bins:
        return bins
    first = max(range(len(bins)), key=lambda b: max(lengths[i] for i in bins[b]))
    rest = [b for b in range(len(bins)) if b != first]
    random.Random(seed).shuffle(rest)
    return [bins[first]] + [bins[b] for b in rest]


def efficiency(lengths: Sequence[int], bins: list[list[int]], capacity: int) -> float:
    """Real tokens over token slots (bins x capacity)."""
    return sum(lengths) / (len(bins) * capacity) if bins else 0.0


def position_ids(seq_lengths: Sequence[int]) -> list[int]:
    return [p for n in seq_lengths for p in range(n)]


# Tokens gathered at a time: the index arrays (about 60 bytes a token, the labels made from the ids and
# the mask bits included) stay near 60 MB however many tokens the data has.
_GATHER_TOKENS = 1 << 20


def gather_rows(
    columns: dict[str, Any], starts: Any, lengths: Any, groups: list[list[int]]
) -> dict[str, Any]:
    """Arrow list columns for rows made of samples: row r of column c holds `columns[c][starts[i]:starts[i]+lengths[i]]`
    for each i in groups[r], one after another. A column is an array, or a function from token positions to
    their values (the labels, made from the ids and the mask bits).

    Returns every column, `position_ids` (restarting at each sample) and `seq_lengths`, each a
    `pyarrow.ChunkedArray` of int32 lists. Vectorised with numpy (no Python object per token), a few
    million tokens at a time, one index shared by the columns.
    """
    import numpy as np
    import pyarrow as pa

    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
    order = np.fromiter((i for g in groups for i in g), dtype=np.int64, count=int(sizes.sum()))
    sel_starts, sel_lens = np.asarray(starts)[order], np.asarray(lengths)[order]
    sample_bounds = np.concatenate([[0], np.cumsum(sizes)])  # row r holds samples [bounds[r], bounds[r+1])
    row_end_tokens = np.cumsum(sel_lens)[sample_bounds[1:] - 1] if len(groups) else np.zeros(0, np.int64)
    chunks: dict[str, list] = {name: [] for name in [*columns, "position_ids", "seq_lengths"]}

    def lists(offsets: Any, vals: Any) -> Any:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(vals, pa.int32()))

    r0 = 0
    while r0 < len(groups):
        done = int(row_end_tokens[r0 - 1]) if r0 else 0
        r1 = max(r0 + 1, int(np.searchsorted(row_end_tokens, done + _GATHER_TOKENS, side="right")))
        s0, s1 = int(sample_bounds[r0]), int(sample_bounds[r1])
        lens, firsts = sel_lens[s0:s1], sel_starts[s0:s1]
        out_starts = np.cumsum(lens) - lens
        within = np.arange(int(lens.sum())) - np.repeat(out_starts, lens)  # position inside its sample
        index = np.repeat(firsts, lens) + within
        row_offsets = np.concatenate([[0], np.cumsum(lens)])[sample_bounds[r0 : r1 + 1] - s0]
        for name, values in columns.items():
            picked = values(index) if callable(values) else np.asarray(values)[index]
            chunks[name].append(lists(row_offsets, picked))
        chunks["position_ids"].append(lists(row_offsets, within))
        chunks["seq_lengths"].append(lists(sample_bounds[r0 : r1 + 1] - s0, lens))
        r0 = r1
    return {name: pa.chunked_array(parts, type=pa.list_(pa.int32())) for name, parts in chunks.items()}
