"""Where to split the short prompts of one step into equal-width calls (scheduler._short_calls).

llama.cpp cuts a per-stream batch into ubatches of consecutive sequence ids with equal rows, so a
call over ids lo..hi pads every id between, a running job's slot too, to the widest prompt. One
call over all of a step's newcomers can then compute many more rows than they have; a call of
its own costs `call_rows` rows. This finds the partition of the sorted ids into runs with the
fewest rows and calls in all: a small dynamic programme over the newcomers of one step.
"""

from __future__ import annotations

from collections.abc import Sequence

UNREACHABLE = 1 << 30


def cheapest_runs(ids: Sequence[int], left: Sequence[int], cells: Sequence[int],
                  call_rows: int) -> list[tuple[int, int]]:
    """Runs (start, end) of indexes into the sorted `ids`, in order. left[i]: rows job i still
    prefills; cells[k]: KV cells free in stream ids[0] + k (a padded stream needs the width)."""
    n, lo = len(ids), ids[0] if ids else 0
    best: list[tuple[int, int]] = [(0, 0)] + [(UNREACHABLE, 0)] * n  # (cost, start of last run)
    for end in range(1, n + 1):
        width, room = 0, UNREACHABLE
        for start in range(end - 1, -1, -1):
            width = max(width, left[start])
            # the run now also pads the ids up to the next member: a running job or a free
            # slot's kept KV there may leave too few cells for the width
            upto = ids[start + 1] if start + 1 < end else ids[start] + 1
            room = min(room, *cells[ids[start] - lo:upto - lo])
            if room < width:
                break
            cost = best[start][0] + (ids[end - 1] - ids[start] + 1) * width + call_rows
            if cost < best[end][0]:
                best[end] = (cost, start)
    runs: list[tuple[int, int]] = []
    end = n
    while end > 0:
        runs.append((best[end][1], end))
        end = best[end][1]
    return runs[::-1]
