"""How much of a long prompt one step may prefill while other jobs stream: stall-free batching.

A step runs the decoders' call and then the prompt chunks beside it, so every running stream's
next token waits for the whole step. A full n_batch chunk of a long prompt (a pasted document)
takes over a second on a small CPU, and the text of every other user freezes that long. As in
Sarathi-Serve, a step's prefill share is sized so the step ends within a target gap
(`max_stall_ms`), from the measured cost of this machine's prompt rows; with no decoder waiting, a
prompt takes whole chunks. Each extra step costs the prompt's TTFT the streams' call and the
step's overhead, so the prompt keeps at least a share of each step that bounds its slowdown
(`max_prefill_slowdown`: beyond its call's fixed cost, rows worth that cost / the slowdown): where
the streams' own step is long, the gap grows instead.

The cost of a prompt row grows with the cells it attends over, so the model is per row and per
cell of context: seconds = CALL + rows * (ROW + CELL * (n_past + rows / 2)), its three terms
fitted to the last prompt-only calls (least squares, in closed form over their running sums, kept
for the last TIMINGS_KEPT calls). Before enough calls are timed, a step takes MIN_ROWS rows: that
times the machine, and the fit takes over.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np


class Prefilling(Protocol):
    n_past: int  # the prompt's rows already in KV


Job = TypeVar("Job", bound=Prefilling)

MIN_ROWS = 32  # a step always moves a prompt on by this many rows (progress, whatever the target)
ROW_QUANTUM = 16  # chunks are cut to whole multiples of this (matmul tiles; fewer odd shapes)
TIMINGS_KEPT = 48  # prompt-only calls the fit looks at
TIMINGS_TRUSTED = 3  # calls timed before the fit sizes chunks
SAFETY = 0.9  # of the time left: the fit is a forecast, and the stream's write follows the step
# the streams' calls and the steps' overheads are read as the median of the last few: the floor a
# prompt gets is 1/max_prefill_slowdown times them, so one slow call (the box busy elsewhere)
# would otherwise make the next chunk ten times as long
RECENT = 7


class PrefillPace:
    """The prompt rows that fit a step beside the decoders, from timed prompt-only calls."""

    def __init__(self, target_seconds: float, max_slowdown: float = 1.0) -> None:
        self.target = target_seconds
        # each paced step gives the prompt rows worth at least 1/slowdown times what the step
        # adds besides them, so its prefill takes about (1 + slowdown) times as long as in whole
        # chunks at most (0: no such floor, the stall target alone)
        self.slowdown = max_slowdown if 0 < max_slowdown < 1 else 0.0
        self._calls: deque[tuple[int, float, float]] = deque(maxlen=TIMINGS_KEPT)
        self._coef: tuple[float, float, float] | None = None
        # wall time of a step beyond its llama_decode calls (sampling, the worker's writes)
        self._step_started: float | None = None
        self._step_decode_seconds = 0.0
        self._extras: deque[float] = deque(maxlen=RECENT)
        self._streams: deque[float] = deque(maxlen=RECENT)  # the decoders' own calls

    def step_started(self, now: float) -> None:
        """A step starts at wall time `now`: what the last one cost beyond its calls (a step
        longer than twice the target had waited for work: not counted)."""
        if self._step_started is not None and now - self._step_started <= 2 * self.target:
            self._extras.append(max(0.0, now - self._step_started - self._step_decode_seconds))
        self._step_started, self._step_decode_seconds = now, 0.0

    def decoded(self, seconds: float, streams: bool = False) -> None:
        """A call of this step took `seconds` (`streams`: the decoders' own call)."""
        self._step_decode_seconds += seconds
        if streams:
            self._streams.append(seconds)

    def streams_seconds(self) -> float:
        """What the decoders' own call costs now (the median of their last calls)."""
        return statistics.median(self._streams) if self._streams else 0.0

    def overhead(self) -> float:
        """What a step costs beyond its calls now (the median of the last steps'); read only
        where a step is paced, not every step (a median per step was ~0.2 ms of numpy)."""
        return statistics.median(self._extras) if self._extras else 0.0

    def alone_budget(self, waited: float) -> float:
        """Seconds a step of newcomers' prompts alone may take, the streams skipping it: their
        wait so far, that step and their next call stay within the target (read once a step)."""
        return self.target * SAFETY - waited - self.streams_seconds() - self.overhead()

    def fits(self, rows: int, n_past: int, budget: float) -> bool:
        """Whether `rows` of a prompt at n_past fit `budget` (untimed: they do)."""
        alone = self.seconds(rows, n_past)
        return alone == 0.0 or alone <= budget

    def cut(self, wanted: Sequence[tuple[Job, int]], waited: float, floor: int) -> list[tuple[Job, int]]:
        """Of each prompt's `wanted` rows (job, rows), in order, what fits this step beside the
        decoders' call after `waited` seconds already spent: the first cut to fit (at least
        `floor` rows), the rest left for later steps. Where the streams' own step nearly fills the
        target, the prompts still get their share of it."""
        decoders = self.streams_seconds()
        fit = self._fit()
        call = fit[0] if fit is not None else 0.0  # a prompt call's own fixed cost, as fitted
        step = decoders + self.overhead()  # what each paced step adds to a prompt's TTFT
        stall = self.target - step - waited
        # (the call's fixed cost is not multiplied: the fit's intercept holds its errors too)
        share = call + step / self.slowdown - waited if self.slowdown else stall
        # (a share is a floor, not a forecast: its rows are rounded up)
        left, margin, least = (stall, SAFETY, False) if stall >= share else (share, 1.0, True)
        cut: list[tuple[Job, int]] = []
        for job, count in wanted:
            rows = self.rows(left * margin, job.n_past, count, floor=0 if cut else floor, at_least=least)
            if not rows:
                break
            cut.append((job, rows))
            left -= self.seconds(rows, job.n_past)
            if rows < count:
                break
        return cut

    def record(self, rows: int, n_past: int, seconds: float) -> None:
        """A prompt-only call of `rows` rows starting at position n_past took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        self._calls.append((rows, n_past + rows / 2, seconds))
        self._coef = None

    def seconds(self, rows: int, n_past: int) -> float:
        """Forecast of a prompt-only call's time (0 while untimed)."""
        coef = self._fit()
        if coef is None:
            return 0.0
        call, row, cell = coef
        return call + rows * (row + cell * (n_past + rows / 2))

    def rows(self, left_seconds: float, n_past: int, wanted: int, floor: int = MIN_ROWS,
             at_least: bool = False) -> int:
        """Rows of a prompt at n_past (of `wanted` still to prefill) whose forecast fits
        `left_seconds` (`at_least`: the fewest whose forecast reaches it); at least `floor`, at
        most `wanted`."""
        if self.target <= 0:
            return wanted
        coef = self._fit()
        if coef is None:
            return min(wanted, floor)
        budget = left_seconds
        lo, hi = 0, wanted  # the largest row count whose forecast fits: the cost grows with rows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.seconds(mid, n_past) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo >= wanted:
            return wanted
        if at_least:
            return min(wanted, max(floor, -(-(lo + 1) // ROW_QUANTUM) * ROW_QUANTUM))
        return min(wanted, max(floor, lo // ROW_QUANTUM * ROW_QUANTUM))

    def _fit(self) -> tuple[float, float, float] | None:
        if self._coef is not None or len(self._calls) < TIMINGS_TRUSTED:
            return self._coef
        data = np.array(self._calls, dtype=np.float64)
        rows, mid, seconds = data[:, 0], data[:, 1], data[:, 2]
        design = np.stack([np.ones_like(rows), rows, rows * mid], axis=1)
        coef, *_ = np.linalg.lstsq(design, seconds, rcond=None)
        call, row, cell = (float(c) for c in coef)
        if row <= 0 or cell < 0 or call < 0:
            # too few shapes to tell the terms apart: per row, all of it (an over-estimate
            # with a call's overhead in it, which errs towards shorter stalls)
            call, row, cell = 0.0, float(np.sum(seconds) / np.sum(rows)), 0.0
        self._coef = (call, row, cell)
        return self._coef
