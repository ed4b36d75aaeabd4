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


def gather_rows(values: Any, starts: Any, lengths: Any, groups: list[list[int]]) -> dict[str, Any]:
    """Arrow list columns for rows made of samples: row r holds `values[starts[i]:starts[i]+lengths[i]]` for i in groups[r].

    Returns `tokens` (the concatenated values), `position_ids` (restarting at each sample) and `seq_lengths`,
    each a `pyarrow.ListArray` of int32. Vectorised with numpy: no Python object per token.
    """
    import numpy as np
    import pyarrow as pa

    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
    order = np.fromiter((i for g in groups for i in g), dtype=np.int64, count=int(sizes.sum()))
    sel_starts, sel_lens = np.asarray(starts)[order], np.asarray(lengths)[order]
    out_starts = np.cumsum(sel_lens) - sel_lens
    total = int(sel_lens.sum())
    shift = np.repeat(out_starts, sel_lens)
    flat = np.asarray(values)[np.repeat(sel_starts, sel_lens) + np.arange(total) - shift]
    positions = np.arange(total) - shift
    sample_bounds = np.concatenate([[0], np.cumsum(sizes)])
    row_offsets = np.concatenate([[0], np.cumsum(sel_lens)])[sample_bounds]

    def lists(offsets: Any, vals: Any) -> Any:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(vals, pa.int32()))

    return {
        "tokens": lists(row_offsets, flat),
        "position_ids": lists(row_offsets, positions),
        "seq_lengths": lists(sample_bounds, sel_lens),
    }
