"""Trace every decode step of an in-process llama.cpp worker, for scripts/step_trace_report.py.

Put this folder on PYTHONPATH and name a file prefix in STEP_TRACE (not FLEET_*: the bench
strips those from a worker's environment): each worker process appends one JSON line per step to
<prefix>.<pid>: when it started, how long it took, the draft tokens kept, and each llama_decode
call's shape (decoders, draft tokens, prompt rows, rows in all) and seconds. Only a probe: it
wraps the engine from outside and changes nothing it measures but a few microseconds a step.

    PYTHONPATH=scripts/step_trace STEP_TRACE=/tmp/trace/chat fleet bench --workload chat ...
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def _install(prefix: str) -> None:
    try:
        from backends.llamacpp import engine
    except ImportError:  # a producer-only process, or no llama-cpp-python: nothing to trace
        return
    out = open(f"{prefix}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 - open for the process's life
    decode_step = engine.LlamaCppBackend._decode_step

    def traced(self: Any, events: list[Any]) -> None:
        calls: list[dict[str, Any]] = []
        run = self.executor.run

        def timed(call: Any) -> int:
            rc = run(call)
            calls.append({"decoders": len(call.decoders), "drafts": sum(len(d) for d in call.drafts.values()),
                          "prompt_rows": sum(n for _, n in call.prompts), "rows": call.n_rows(),
                          "s": round(self.executor.last_decode_seconds, 5)})
            return rc

        kept = self.scheduler.draft_accepted
        t0 = time.perf_counter()
        self.executor.run = timed
        try:
            decode_step(self, events)
        finally:
            del self.executor.run  # the instance attribute goes, the class's method shows again
        out.write(json.dumps({"t": round(t0, 5), "s": round(time.perf_counter() - t0, 5),
                              "kept": self.scheduler.draft_accepted - kept, "calls": calls}) + "\n")

    engine.LlamaCppBackend._decode_step = traced  # type: ignore[method-assign]


if os.environ.get("STEP_TRACE"):
    _install(os.environ["STEP_TRACE"])
