"""The in-process llama.cpp engine, split the way vLLM v1 splits its engine core.

- `scheduler.py` (pure): which sequences run this step, their rows, prefill vs decode,
  the chunked-prefill budget, admission; its output is a `StepPlan` (with the KV operations to
  apply first). After each call it moves the jobs on by what was sampled (`update`, with the
  finish and draft rules of `updates.py`, pure too).
- `kv.py` (pure): the KV bookkeeper: sequence ids, KV kept per slot, the prefix LRU,
  reservations (unified pool) and prefix-reuse decisions; it logs the memory operations it wants.
- `executor.py`: the only step-path module that calls llama.cpp: applies the plans' KV
  operations (`llama_memory_seq_rm/seq_cp`), fills batches, `llama_decode`, sampler chains.
- `model.py`: loading a GGUF model and its context, tokenizing; `invariance.py` (pure): which
  reused KV keeps a job batch-invariant; `text.py`: token bytes -> text deltas, stop strings.
- `engine.py`: `LlamaCppBackend`, the Backend protocol over the three: plan -> executor ->
  scheduler.update -> events. Calls go one way (the bookkeeper is called, it calls no one).

Importing this package does not import llama_cpp: `LlamaCppBackend` is loaded on first use, so
the pure modules (and their tests) need no native library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.llamacpp.engine import LlamaCppBackend

__all__ = ["LlamaCppBackend"]


def __getattr__(name: str) -> object:
    if name == "LlamaCppBackend":
        from backends.llamacpp.engine import LlamaCppBackend

        return LlamaCppBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
