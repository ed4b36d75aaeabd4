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
from collections.abc import Iterator, Sequence
from typing import Any, Optional


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


class Gathering:
    """Rows made of samples, gathered a few million tokens at a time: row r of column c holds
    `columns[c][starts[i]:starts[i]+lengths[i]]` for each i in groups[r], one after another, plus
    `position_ids` (restarting at each sample) and `seq_lengths`, all int32 lists.

    `pieces` yields them piece by piece, so that a caller writing them (`rows.save`) holds one piece, never
    every row; `list_nbytes` is what the pieces' Arrow arrays take, known before any is made. Vectorised with
    numpy (no Python object per token), one index shared by the columns.
    """

    def __init__(
        self, starts: Any, lengths: Any, groups: Optional[Sequence[Sequence[int]]], within: Any = None
    ) -> None:
        """`groups` name samples, or (`within` given) positions in the array `within` of sample numbers, as the
        packed bins list positions in the training rows (read here without a copy of every bin); None: each
        sample of `within` a row of its own (the eval rows)."""
        import numpy as np

        if groups is None:
            order = np.asarray(within, dtype=np.int64)
            sizes = np.ones(len(order), dtype=np.int64)
        else:
            sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
            order = np.fromiter((i for g in groups for i in g), dtype=np.int64, count=int(sizes.sum()))
            if within is not None:
                order = np.asarray(within, dtype=np.int64)[order]
        self.sel_starts, self.sel_lens = np.asarray(starts)[order], np.asarray(lengths)[order]
        # Row r holds samples [bounds[r], bounds[r+1]).
        self.sample_bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_rows = len(sizes)
        row_end = (
            np.cumsum(self.sel_lens)[self.sample_bounds[1:] - 1] if len(sizes) else np.zeros(0, np.int64)
        )
        self.spans: list[tuple[int, int]] = []  # the rows [r0, r1) of each piece
        r0 = 0
        while r0 < self.num_rows:
            done = int(row_end[r0 - 1]) if r0 else 0
            r1 = max(r0 + 1, int(np.searchsorted(row_end, done + _GATHER_TOKENS, side="right")))
            self.spans.append((r0, r1))
            r0 = r1

    def list_nbytes(self, per: str) -> int:
        """The Arrow bytes (pyarrow's `nbytes`) of one int32 list column over every piece, no validity: four a row
        (pyarrow counts an offset a list) and four a token (`per="token"`: the token columns, position ids) or a
        sample (`per="sample"`: `seq_lengths`)."""
        values = int(self.sel_lens.sum()) if per == "token" else len(self.sel_lens)
        return 4 * self.num_rows + 4 * values

    def pieces(self, columns: dict[str, Any]) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
        """((r0, r1), arrays) for each piece of rows: every column (an array, or a function from token
        positions to their values, as the labels made from the ids and the mask bits), then `position_ids`
        and `seq_lengths`, each a `pyarrow.ListArray` of int32."""
        import numpy as np
        import pyarrow as pa

        def lists(offsets: Any, vals: Any) -> Any:
            return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(vals, pa.int32()))

        for r0, r1 in self.spans:
            s0, s1 = int(self.sample_bounds[r0]), int(self.sample_bounds[r1])
            lens, firsts = self.sel_lens[s0:s1], self.sel_starts[s0:s1]
            out_starts = np.cumsum(lens) - lens
            within = np.arange(int(lens.sum())) - np.repeat(out_starts, lens)  # position inside its sample
            index = np.repeat(firsts, lens) + within
            row_offsets = np.concatenate([[0], np.cumsum(lens)])[self.sample_bounds[r0 : r1 + 1] - s0]
            arrays = {}
            for name, values in columns.items():
                picked = values(index) if callable(values) else np.asarray(values)[index]
                arrays[name] = lists(row_offsets, picked)
            arrays["position_ids"] = lists(row_offsets, within)
            arrays["seq_lengths"] = lists(self.sample_bounds[r0 : r1 + 1] - s0, lens)
            yield (r0, r1), arrays


def gather_rows(
    columns: dict[str, Any], starts: Any, lengths: Any, groups: list[list[int]]
) -> dict[str, Any]:
    """Every piece of `Gathering(starts, lengths, groups)` at once: each column, `position_ids` and
    `seq_lengths` as a `pyarrow.ChunkedArray` of int32 lists (for tests and benchmarks; the stage writes
    the pieces as they come)."""
    import pyarrow as pa

    chunks: dict[str, list] = {name: [] for name in [*columns, "position_ids", "seq_lengths"]}
    for _, arrays in Gathering(starts, lengths, groups).pieces(columns):
        for name, array in arrays.items():
            chunks[name].append(array)
    return {name: pa.chunked_array(parts, type=pa.list_(pa.int32())) for name, parts in chunks.items()}
