"""Text jobs in the worker (tokenize, detokenize, apply-template: backends/contract/text_ops.py),
answered on a thread of their own so the loop's streams never wait for them.

A text job needs no decode, but tokenizing a long text is not short: 1M characters of prose take
seconds, and a run of characters without a space tokenizes in quadratic time (131,072
hieroglyphs, gemma's tokenizer: 12 s). On the loop's thread that froze every running stream for
as long. llama.cpp's calls release the GIL (ctypes), and reading a vocabulary and a template
beside a decode is what llama-server's HTTP threads do while its loop decodes, so the engine's
`text_op` runs here, one job at a time, at a lower CPU priority than the decode threads; the loop
takes the finished jobs' events at each step, as it takes the engine's. The answer is encoded to
JSON here too (212k tokens with their pieces: ~0.9 s of the loop's time when it was not).

A job waiting or running here holds one of the worker's slots (the claim counts it, as it counts
a waiting embedding job), so a flood of text jobs is shared among the pool's workers rather than
claimed by one. Its size is bounded before it gets here, as a prompt's is (worker/serving/limits.py),
and the tokens it handled count as its tenant's (usage, tokens_per_minute).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from backends.base import Backend, BackendUnavailable, Done, Event, Failed, JobRejected, TextOps
from backends.contract import tools
from backends.contract.schema import GenerateRequest
from backends.contract.text_ops import REJECTED, TextRequest, encode_answer
from backends.shelf import ModelView

log = logging.getLogger("fleet.worker")
NICER = 5  # the text thread's niceness above the worker's: a core it shares goes to decoding first


@dataclass
class _Running:
    job_id: str
    future: Future[Event]
    engine: Backend | TextOps

    def release(self) -> None:
        """The job ended: its catalogue model may be unloaded again."""
        if isinstance(self.engine, ModelView):
            self.engine.release(self.job_id)


class TextJobs:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-jobs",
                                        initializer=_lower_priority)
        self.jobs: dict[str, _Running] = {}  # not ended yet, oldest first
        self._orphans: list[_Running] = []  # cancelled while running: their slot is held until they end
        self._ended: list[Event] = []  # cancelled since the last step

    def held(self) -> int:
        """Slots taken: jobs waiting or running, and cancelled ones still running."""
        return len(self.jobs) + len(self._orphans)

    def add(self, job_id: str, request: TextRequest, engine: Backend | TextOps) -> None:
        """Answer the job on the text thread; its event comes from a later `step`. A catalogue
        model stays loaded until the job ends."""
        if isinstance(engine, ModelView):
            engine.hold(job_id)
        self.jobs[job_id] = _Running(job_id, self._pool.submit(answer_text, engine, job_id, request), engine)

    def cancel(self, job_id: str) -> bool:
        """True when it was a text job here: it ends cancelled at the next step (its answer, if
        it is being made, is dropped)."""
        running = self.jobs.pop(job_id, None)
        if running is None:
            return False
        if running.future.cancel():
            running.release()
        else:
            self._orphans.append(running)
        self._ended.append(Done(job_id, "cancelled", 0, 0))
        return True

    def step(self, timeout: float = 0.0) -> list[Event]:
        """The events of the jobs answered since the last call, waiting up to `timeout` for the
        first when none is."""
        events, self._ended = self._ended, []
        if timeout > 0 and not events and self.jobs and not any(r.future.done() for r in self.jobs.values()):
            wait([r.future for r in self.jobs.values()], timeout, return_when=FIRST_COMPLETED)
        for running in [r for r in self.jobs.values() if r.future.done()]:
            del self.jobs[running.job_id]
            running.release()
            events.append(_event_of(running))
        for running in [r for r in self._orphans if r.future.done()]:
            self._orphans.remove(running)
            running.release()
        return events

    def close(self) -> None:
        """Wait for the job being answered (the engine it reads must outlive it); drop the rest."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _event_of(running: _Running) -> Event:
    """answer_text returns every failure as an event; anything else still ends the job."""
    error = running.future.exception()
    if error is None:
        return running.future.result()
    return Failed(running.job_id, f"internal error answering a text job: {error}")


def _lower_priority() -> None:
    """Linux: a thread is a task with its own niceness (raising it needs no privilege)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICER)


def answer_text(backend: Backend | TextOps, job_id: str, request: TextRequest) -> Event:
    """A text job's answer (in the result's `answer`), or its failure: the model cannot take the
    request, or this engine does not tokenize (REJECTED: the gateway's 400), or the engine is
    unreachable (retried like any job). Never raises: it runs on the text thread."""
    if not isinstance(backend, TextOps):
        return Failed(job_id, f"{REJECTED}this worker's engine ({backend.name}) does not tokenize")
    try:
        if request.chat is not None:
            request = request.model_copy(update={"chat": as_run(backend, request.chat)})
        answer = backend.text_op(request)
    except JobRejected as e:
        return Failed(job_id, f"{REJECTED}{e}")
    except BackendUnavailable as e:
        return Failed(job_id, str(e), retryable=True)
    except Exception as e:  # one odd request must not end the worker
        log.exception("text job %s failed", job_id)
        return Failed(job_id, f"internal error answering a text job: {e}")
    return Done(job_id, "stop", request.tokens_handled(answer), 0, extra={"answer": encode_answer(answer)})


def as_run(backend: object, chat: GenerateRequest) -> GenerateRequest:
    """The chat as a generation job of it runs (so apply-template shows the prompt that job
    gets): as sent where the engine speaks its model's own dialect (`speaks`), else lowered to
    the generic tool format, the rule rqjobs.load applies."""
    speaks = getattr(backend, "speaks", None)
    return chat if speaks is not None and speaks(chat) else tools.lower(chat)[0]
