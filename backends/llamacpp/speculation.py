"""Speculative decoding without a draft model (prompt lookup): the rules, without llama.cpp.

A decoding job proposes up to k tokens copied from its own prompt or output: the tokens that
followed the most recent earlier occurrence of its last n tokens (n from NGRAM_MAX down to
NGRAM_MIN). The proposal rides in the decoders' `llama_decode` as extra rows with logits; the
engine samples row by row and keeps a draft token only while it equals what was sampled, so
the text is what decoding one token at a time gives (the sampler sees the same logits in the
same order; a seeded chain draws the same numbers). The KV of the rejected rest is removed.

When it pays, and why the text stays the same: ggml's CPU matmul takes a per-row `vec_dot`
kernel below TILED_MM_ROWS rows and a tiled kernel from there (they round differently). A lone
decoder runs in the `vec_dot` regime; so does its verification as long as the whole decoders'
call stays below TILED_MM_ROWS rows. Drafts are therefore only proposed while
(sequence ids in the call) x (1 + draft) < TILED_MM_ROWS: one to three busy slots. That is also
where it pays: a step of a few rows costs about what one row costs (the weights are read once),
while a full batch is compute-bound and extra rows are not free. With `batch_invariant` the
tiled kernel runs at every size, so the rule keeps the text unchanged there too.

Only plain jobs draft (`Sampling.is_plain`): a grammar, the penalties' history and the logprobs
advance with every token, so those jobs decode one token at a time (simple, and surely right).

How many to draft is decided per job from its own record (`NgramIndex.budget`): a draft row is
not free (on gemma-3-270m a 7-row step costs about three 1-row steps: every row with logits pays
the 262k-word output layer), so the k-th draft token is worth proposing only while the chance
that it is kept, p^k (p: the job's recent per-token acceptance), exceeds ROW_COST. A summary that
rewrites its passage keeps ~40 % of its drafts and then drafts one token or none; a copy keeps
~90 % and drafts the full k. A job that stopped drafting tries one token every PROBE_EVERY steps.
"""

from __future__ import annotations

import math

from backends.llamacpp.invariance import TILED_MM_ROWS

NGRAM_MAX = 4  # longest suffix looked up
NGRAM_MIN = 2  # a single repeated token predicts too little to pay for its rows
ROW_COST = 0.33  # a draft row's cost in 1-row steps (measured, docs/bench.md: 7 rows ~ 3 steps)
DECAY = 0.8  # weight of the older drafted steps in a job's acceptance record, per drafted step
PROBE_EVERY = 16  # steps without a draft before a job tries one token again


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

    def budget(self, k: int) -> int:
        """How many of at most k draft tokens are worth their rows, from this job's record."""
        p = self._hits / (self._hits + self._misses)
        worth = k if p >= 1.0 else (0 if p <= ROW_COST else int(math.log(ROW_COST) / math.log(p)))
        if min(k, worth) > 0:
            return min(k, worth)
        self._idle += 1
        if self._idle >= PROBE_EVERY and k > 0:  # try again now and then: the text may change
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


def draft_room(n_ids: int, k_max: int) -> int:
    """Draft tokens each decoder may propose when the decoders' call covers n_ids sequence ids
    (equal-width ubatch): the call must stay below TILED_MM_ROWS rows (see the module doc)."""
    if n_ids <= 0:
        return 0
    width = (TILED_MM_ROWS - 1) // n_ids
    return max(0, min(k_max, width - 1))
