"""Speculative decoding without a draft model (prompt lookup): the rules, without llama.cpp.

A decoding job proposes up to k tokens copied from its own prompt or output: the tokens that
followed the most recent earlier occurrence of its last n tokens (n from NGRAM_MAX down to
NGRAM_MIN). The proposal rides in the decoders' `llama_decode` as extra rows with logits; the
engine samples row by row and keeps a draft token only while it equals what was sampled, so
the text is what decoding one token at a time gives (the sampler sees the same logits in the
same order; a seeded chain draws the same numbers; up to the kernel, below). The KV of the
rejected rest is removed.

How far a call may draft: ggml's CPU matmul takes a per-row `vec_dot` kernel below
TILED_MM_ROWS rows and a tiled kernel from there (they round differently). Every row here carries
logits, and the output layer (262k words x 640 on gemma-3-270m) makes a row with logits cost
about as much as the rest of the model: in the `vec_dot` regime rows cost about what they add
(one decoder 10.6 ms, 4 decoders 33 ms on a 2-core AMD EPYC), while the tiled kernel gets cheaper
a row as rows grow (4 decoders x 4 rows: 58 ms, x 7 rows: 92 ms). So a few decoders copying
text gain most by drafting into the tiled regime. A drafted call holds at most DRAFT_CALL_ROWS
rows (the logits buffer holds that many): calls of 2 to 8 sequence ids draft, 9 and more do not;
a lone decoder drafts at most TILED_MM_ROWS - 2 tokens, so it stays with its own kernel. Every id
of an equal-width call gets the widest draft's rows, so drafts also stop short of the fullest
stream's last cell.

What that does to the text: a kept draft token is the argmax (or the seeded draw) of its own
logits row, as in one-token steps; but when drafts take the call across TILED_MM_ROWS, those
logits come from the tiled kernel, and at a near-tie the text can differ from one-token decoding,
as it already differs with the number of jobs decoding (8 decoders run tiled, 7 do not). With
`batch_invariant` the tiled kernel runs at every size: the text is then the same with and without
speculation, alone or batched, bit for bit.

Only plain jobs draft (`Sampling.is_plain`): a grammar, the penalties' history and the logprobs
advance with every token, so those jobs decode one token at a time (simple, and surely right).
But for a lazy grammar (a model's own calls, tool_choice auto) before its trigger: it constrains
nothing yet, so such a job drafts until the token at which it fires (lazy_trigger.py), its
draft kept only that far, and decodes one token at a time from there (`may_draft`).

How many to draft is decided per step from two records: the job's own acceptance (p: the chance
a draft token is kept, decayed over its recent drafted steps) and what decoders' calls of each
shape cost on this machine (`StepCosts`, learned from the executor's timings). Draft rows are not
free: every row with logits pays the output layer (262k words x 640 on gemma-3-270m), and ggml's
kernels make the cost a staircase, not a line (measured on one CPU: 2, 4 and 7 rows with logits
cost 2.3, 2.7 and 5.2 one-row steps). So the job drafts the j tokens (0 <= j <= k) that give the
most expected tokens per unit of time, (others + 1 + p + ... + p^j) / cost(j), where cost(j) is
the call with every decoder that has something to propose drafting j, and `others` the tokens of
the undrafted decoders sharing it, per drafter: a copy (p ~ 0.9) drafts to the cheap end of a
stair, a summary (p ~ 0.4) not at all. A job that stopped drafting tries one token every
PROBE_EVERY steps in which it had something to propose.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from backends.contract.schema import Sampling
from backends.llamacpp.invariance import TILED_MM_ROWS
from backends.llamacpp.lazy_trigger import mirrors

NGRAM_MAX = 4  # longest suffix looked up
NGRAM_MIN = 2  # a single repeated token predicts too little to pay for its rows
DECAY = 0.8  # weight of the older drafted steps in a job's acceptance record, per drafted step
PROBE_EVERY = 16  # steps without a draft before a job tries one token again
# a call shape not timed yet looks cheap (each extra row with logits 0.2 calls, a throw-away pad
# row nothing): it gets tried
PRIOR_ROW_COST = 0.2
DRAFT_CALL_ROWS = 16  # rows of a drafted decoders' call at most (the logits buffer's rows)
TIMINGS_KEPT = 8  # per call shape: the median of the last few timings (one slow step is noise)
TIMINGS_TRUSTED = 3  # timings of a shape before they replace the prior


class NgramIndex:
    """A job's tokens (prompt, then output) and, for every n-gram of NGRAM_MIN..NGRAM_MAX tokens,
    the position right after its latest and its first occurrence that has a follower. Appending a
    token and proposing a draft cost O(NGRAM_MAX) dictionary operations, whatever the length."""

    __slots__ = ("_after", "_first", "_hits", "_idle", "_misses", "_n_prompt", "tokens")

    def __init__(self, prompt: list[int]) -> None:
        self.tokens: list[int] = []
        # acceptance record: tokens kept and drafts cut short (decayed); the prior is a good drafter
        self._hits, self._misses, self._idle = 1.8, 0.2, 0
        self._after: dict[tuple[int, ...], int] = {}
        self._first: dict[tuple[int, ...], int] = {}
        for tok in prompt:
            self.append(tok)
        self._n_prompt = len(prompt)

    def follow(self, output: list[int]) -> None:
        """Index the job's output tokens not seen yet (the output only grows)."""
        for tok in output[len(self.tokens) - self._n_prompt:]:
            self.append(tok)

    def append(self, token: int) -> None:
        toks = self.tokens
        toks.append(token)
        end = len(toks) - 1  # the new token follows the n-grams ending just before it
        for n in range(NGRAM_MIN, NGRAM_MAX + 1):
            if end - n < 0:
                break
            key = tuple(toks[end - n:end])
            self._after[key] = end
            self._first.setdefault(key, end)

    def budget(self, costs: Sequence[float], others: float = 0.0) -> int:
        """How many draft tokens to propose, given costs[j] = the call's cost with j draft tokens
        (costs[0]: without; len(costs) - 1 is the most allowed): the j with the most expected
        tokens per unit of cost, from this job's acceptance record. `others`: the tokens the
        call's undrafted decoders give, per drafting one (they share the call's cost)."""
        p = self._hits / (self._hits + self._misses)
        best, best_rate, expected = 0, (others + 1.0) / costs[0], others + 1.0
        for j in range(1, len(costs)):
            expected += p ** j
            if expected / costs[j] > best_rate:
                best, best_rate = j, expected / costs[j]
        if best > 0:
            return best
        self._idle += 1
        if self._idle >= PROBE_EVERY and len(costs) > 1:  # try again now and then: the text may change
            self._idle = 0
            return 1
        return 0

    def record(self, proposed: int, kept: int) -> None:
        """A drafted step's outcome: `kept` of `proposed` draft tokens were kept."""
        self._hits = self._hits * DECAY + kept
        self._misses = self._misses * DECAY + (1 if kept < proposed else 0)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix (or the
        first occurrence, when the latest is too close to the end to give k: a loop)."""
        toks = self.tokens
        if k <= 0:
            return []
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(toks) <= n:
                continue
            key = tuple(toks[-n:])
            start = self._after.get(key)
            if start is not None:
                if len(toks) - start < k:
                    start = self._first[key]
                return toks[start:start + k]
        return []


def may_draft(s: Sampling) -> bool:
    """A plain job, or one that is plain but for a lazy grammar whose trigger Python sees."""
    if s.is_plain():
        return True
    lazy = s.format is None and s.dialect is not None and s.dialect.lazy and s.dialect.gbnf is not None
    return (lazy and s.dialect is not None and s.top_logprobs is None and not s.has_penalties()
            and mirrors(s.dialect.triggers))


def draft_room(n_ids: int, k_max: int) -> int:
    """Draft tokens each decoder may propose when the decoders' call covers n_ids sequence ids
    (equal-width ubatch): the call holds at most DRAFT_CALL_ROWS rows, and a lone decoder's
    stays under TILED_MM_ROWS, the kernel it decodes with undrafted (see the module doc)."""
    if n_ids <= 0:
        return 0
    if n_ids == 1:
        return min(k_max, TILED_MM_ROWS - 2)
    return max(0, min(k_max, DRAFT_CALL_ROWS // n_ids - 1))


class StepCosts:
    """Seconds a decoders-only call takes, by its shape (rows, rows with logits), from the
    executor's timings on this machine: what the draft budget weighs (see the module doc).
    A shape timed fewer than TIMINGS_TRUSTED times costs the optimistic prior, so it gets tried."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, int], deque[float]] = {}

    def record(self, rows: int, outputs: int, seconds: float) -> None:
        self._seconds.setdefault((rows, outputs), deque(maxlen=TIMINGS_KEPT)).append(seconds)

    def relative(self, shape: tuple[int, int], base: tuple[int, int]) -> float:
        """Cost of a call of `shape` in calls of `base`."""
        timed, timed_base = self._seconds.get(shape), self._seconds.get(base)
        if (timed is None or timed_base is None or len(timed) < TIMINGS_TRUSTED
                or len(timed_base) < TIMINGS_TRUSTED):
            return 1.0 + PRIOR_ROW_COST * (shape[1] - base[1])
        return statistics.median(timed) / statistics.median(timed_base)
