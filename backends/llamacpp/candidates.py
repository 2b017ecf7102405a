"""Candidate arrays a sequence's sampler hands llama.cpp's samplers, filled from a logits row with
numpy: the whole vocabulary (`Candidates`, for grammars) or only the tokens near the best logit
(`TopCandidates`, for chains that start with top-k). See sampling.py."""

from __future__ import annotations

import math

import llama_cpp as ll
import numpy as np

TOP_CAPACITY = 4096  # most candidates TopCandidates hands a top-k chain


class Candidates:
    """A reusable llama_token_data array over the whole vocabulary, filled from a logits row with
    numpy (what llama_sampler_sample does in C), for jobs that need the grammar between steps."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._data = (ll.llama_token_data * n_vocab)()
        self._view = np.ctypeslib.as_array(self._data)  # fields id, logit, p
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.array = ll.llama_token_data_array(self._data, n_vocab, -1, False)

    def fill(self, logits: np.ndarray) -> ll.llama_token_data_array:
        self._view["id"] = self._ids  # samplers sort and cut the array in place: refill it all
        self._view["logit"] = logits
        self._view["p"] = 0.0
        return self._reset(self.n_vocab)

    def fill_best(self, logits: np.ndarray, n: int) -> ll.llama_token_data_array:
        """Only the n best logits (in no order)."""
        best = np.argpartition(logits, -n)[-n:]
        self._view["id"][:n] = best
        self._view["logit"][:n] = logits[best]
        self._view["p"][:n] = 0.0
        return self._reset(n)

    def passing(self) -> int:
        """How many candidates of the array have not been ruled out (logit -inf)."""
        return int(np.count_nonzero(self._view["logit"][: self.array.size] != -np.inf))

    def _reset(self, size: int) -> ll.llama_token_data_array:
        self.array.size = size
        self.array.selected = -1
        self.array.sorted = False
        return self.array

    def selected(self) -> tuple[int, float]:
        picked = self._data[self.array.selected]
        return int(picked.id), float(picked.logit)


class TopCandidates:
    """What a chain that starts with top-k can pick from, found in place with numpy: every token
    whose logit lies within a margin of the best, the margin chosen (by halving or doubling it) so
    that at least k and at most `capacity` tokens pass. The k best are then all in the array, so
    the chain's top-k keeps exactly the tokens, in the same order, that it keeps from the whole
    vocabulary, and its seeded draw is the same. llama_sampler_sample copies every logit into a
    candidate struct first (0.2-0.6 ms a row on a 262k vocabulary: per sequence, per step); this
    costs a few passes of numpy over the row (0.08 ms)."""

    def __init__(self, capacity: int = TOP_CAPACITY) -> None:
        self.capacity = capacity
        self._data = (ll.llama_token_data * capacity)()
        self._view = np.ctypeslib.as_array(self._data)  # fields id, logit, p
        self.array = ll.llama_token_data_array(self._data, 0, -1, False)

    def fill(self, logits: np.ndarray, k: int) -> ll.llama_token_data_array | None:
        """None when no margin lets k to `capacity` tokens through (a flat row): sample in C."""
        best = float(logits.max())
        if not math.isfinite(best):
            return None
        margin, too_few, too_many = 8.0, 0.0, math.inf
        for _ in range(12):
            passing = logits >= best - margin
            n = int(np.count_nonzero(passing))
            if n < k:
                too_few = margin
            elif n > self.capacity:
                too_many = margin
            else:
                ids = np.flatnonzero(passing)
                self._view["id"][:n] = ids
                self._view["logit"][:n] = logits[ids]
                self._view["p"][:n] = 0.0
                self.array.size = n
                self.array.selected = -1
                self.array.sorted = False
                return self.array
            margin = margin * 2 if too_many == math.inf else (too_few + too_many) / 2
        return None

    def selected(self) -> int:
        return int(self._data[self.array.selected].id)
