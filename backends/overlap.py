"""`OverlappedBackend`: the next engine step decodes while the worker writes the last one's tokens.

The worker loop is serial: step (a `llama_decode`), then one Redis pipeline for the tokens and
cancel checks, then a claim. On a 2-core box at 4 users the Redis part is 2-3 ms of a ~40 ms step,
and the cores sit idle meanwhile. `llama_decode` releases the GIL (ctypes), so the wrapped
backend's `step()` runs on one helper thread and `step()` here returns the events of the step
that just ended while launching the next: the Redis round trips happen during a decode.

The wrapped engine is never entered from two threads at once: `admit` and `cancel` wait for the
step in flight (they are rare: once per job), and `free_slots()` answers from a count taken when
the engine was last still (a step only frees slots, so the count is never too high).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from backends.base import (
    Backend,
    Bilingual,
    Embedder,
    Embedding,
    Event,
    GenerateRequest,
    JobRejected,
    Scorer,
    Scores,
)
from backends.contract.text_ops import TextRequest


class OverlappedBackend:
    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.slots = inner.slots
        # one thread, always the same: ggml's compute threads stay with the thread that decodes
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{inner.name}-step")
        self._lock = threading.Lock()  # held while the engine is inside a call
        self._running: Future[list[Event]] | None = None
        self._free = inner.free_slots()
        self.embed_batch = inner.embed_batch if isinstance(inner, Embedder) else 1
        self.score_batch = inner.score_batch if isinstance(inner, Scorer) else 1

    def free_slots(self) -> int:
        return self._free

    def probe(self) -> bool:
        return self.inner.probe()

    def speaks(self, request: GenerateRequest) -> bool:
        """The engine's own dialect, as the engine says (it reads only its settings: no lock)."""
        return isinstance(self.inner, Bilingual) and self.inner.speaks(request)

    def stats(self) -> dict[str, object]:
        return self.inner.stats()  # counters only: a read during a step is at worst one step old

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        with self._lock:
            try:
                self.inner.admit(job_id, request)
            finally:
                self._free = self.inner.free_slots()

    def embed(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        """Between steps, like admit (an embedding context decodes on the same cores)."""
        if not isinstance(self.inner, Embedder):
            raise JobRejected(f"this worker's engine ({self.name}) does not embed")
        with self._lock:
            return self.inner.embed(texts, truncate)

    def score(self, query: str, instruction: str, documents: Sequence[str]) -> Scores:
        """Between steps, like embed."""
        if not isinstance(self.inner, Scorer):
            raise JobRejected(f"this worker's engine ({self.name}) does not rerank")
        with self._lock:
            return self.inner.score(query, instruction, documents)

    def text_op(self, request: TextRequest) -> dict[str, object]:
        """Beside a step, not between: it reads only the vocabulary and the template (TextOps),
        and a long text would otherwise hold the next step for as long as it takes."""
        answer = getattr(self.inner, "text_op", None)  # backends.base.TextOps
        if answer is None:
            raise JobRejected(f"this worker's engine ({self.name}) does not tokenize")
        return answer(request)

    def cancel(self, job_id: str) -> None:
        with self._lock:
            self.inner.cancel(job_id)
            self._free = self.inner.free_slots()

    def step(self, timeout: float = 0.0) -> list[Event]:
        """The events of the step in flight (waiting for it), with the next one launched.
        With nothing in flight yet, the step launched now is waited for when `timeout` > 0."""
        events = self._join()
        self._launch(timeout)
        if not events and timeout > 0:
            events = self._join()
            self._launch(timeout)
        return events

    def close(self) -> None:
        try:
            self._join()
        finally:
            self._thread.shutdown(wait=True)
            self.inner.close()

    def _launch(self, timeout: float) -> None:
        self._running = self._thread.submit(self._locked_step, timeout)

    def _join(self) -> list[Event]:
        running, self._running = self._running, None
        return running.result() if running is not None else []  # an engine error is raised here

    def _locked_step(self, timeout: float) -> list[Event]:
        with self._lock:
            try:
                return self.inner.step(timeout)
            finally:
                self._free = self.inner.free_slots()
