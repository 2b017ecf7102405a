"""How big one worker is and how many workers a queue calls for: the numbers behind the Kubernetes
render (memory requests, the KEDA target) and `fleet scale --suggest`.

Memory (docs/placement.md, measured with scripts/measure-memory on the embedded gemma-3-270m
Q4_K_M): a worker's resident size is the model mapping (235 MiB) + its KV cache + ~129 MiB
(interpreter and imports, the 262k-token vocabulary, compute and logit buffers). In a container
the mapped model counts against the memory limit (page cache is charged to the cgroup), so it
is included. KV per cell is 18 KiB for that model (18 layers x (256 K + 256 V) f16); 15 of the 18
layers attend to a sliding window of 512 positions, and per-slot streams keep only that window
(plus one n_batch of new cells) in them. For another model the estimate scales the mapping by its
file size and keeps these per-cell figures, so pass `--memory-mib` when you have measured yours.

Throughput (docs/bench.md): one worker decoding 16 sequences on 2 cores made 190-250 tok/s;
MEASURED_TOK_S_PER_CORE is the low end per core.

Scaling: a job waiting in the queue starts when a slot frees up. With N workers each finishing
J jobs/s, the job at depth D waits about D / (N x J) seconds, so a TTFT target T needs
N = ceil(D / (J x T)). KEDA's HPA computes exactly ceil(total / target) for an AverageValue
target, so the ScaledObject's target is `queue_target_per_worker(J, T)` = floor(J x T) and
`workers_needed` is the same division: one formula for the autoscaler and for the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from backends.contract.settings import EngineSettings
from backends.llamacpp_settings import LlamaCppSettings
from backends.registry import Chained

MODEL_MAPPING_MIB = 235.0  # embedded model file, mapped read-only (measured)
WORKER_OVERHEAD_MIB = 129.0  # everything but weights and KV (measured: extra worker = KV + ~129 MiB)
KV_KIB_PER_CELL = 18.0  # gemma-3-270m, f16 K and V, every layer
WINDOW_KIB_PER_CELL = 15.0  # ... of which its sliding-window layers
WINDOW_POSITIONS = 512  # gemma-3-270m's sliding window
HEADROOM = 1.10  # on top of the estimate: the limit is a hard OOM kill
MEASURED_TOK_S_PER_CORE = 95.0  # 190 tok/s at 16 slots on 2 cores (docs/bench.md, low end)


def kv_kib(backend: LlamaCppSettings) -> float:
    """The KV cache of one in-process engine (backends/llamacpp/engine.py: the KV layouts)."""
    if backend.kv_unified:
        return backend.n_ctx * KV_KIB_PER_CELL
    per_stream = backend.n_ctx_per_seq * KV_KIB_PER_CELL
    if not backend.batch_invariant:  # windowed layers keep the window + a batch, rounded to 256
        window = min(backend.n_ctx_per_seq, -(-(WINDOW_POSITIONS + backend.n_batch) // 256) * 256)
        per_stream -= (backend.n_ctx_per_seq - window) * WINDOW_KIB_PER_CELL
    return (backend.slots + backend.prefix_cache) * per_stream


def worker_memory_mib(backend: EngineSettings) -> int:
    """Memory request = limit for one worker, MiB (estimate x HEADROOM, rounded up to 16 MiB).
    HTTP backends hold no model (it lives in llama-server / Ollama); an in-process engine of the
    fallback chain counts as well, since the chain may run it beside the primary."""
    chain = [backend, *(backend.fallback if isinstance(backend, Chained) else [])]
    engines_mib = 0.0
    for engine in chain:
        if isinstance(engine, LlamaCppSettings):
            mapping = MODEL_MAPPING_MIB
            if engine.model_path is not None and Path(engine.model_path).exists():
                mapping = Path(engine.model_path).stat().st_size / 2**20
            engines_mib += mapping + kv_kib(engine) / 1024
    total = (engines_mib + WORKER_OVERHEAD_MIB) * HEADROOM
    return int(math.ceil(total / 16) * 16)


@dataclass(frozen=True)
class Throughput:
    """What one worker finishes: tokens/s and jobs/s at full slots."""

    tokens_per_s: float
    tokens_per_job: int

    @property
    def jobs_per_s(self) -> float:
        return self.tokens_per_s / max(1, self.tokens_per_job)

    @classmethod
    def measured(cls, cores: int, tokens_per_job: int) -> Throughput:
        return cls(MEASURED_TOK_S_PER_CORE * cores, tokens_per_job)


def queue_target_per_worker(jobs_per_s: float, ttft_target_s: float) -> int:
    """Queued jobs one worker can start within the TTFT target: KEDA's listLength / target."""
    if jobs_per_s <= 0 or ttft_target_s <= 0:
        raise ValueError("jobs per second and the TTFT target must be positive")
    return max(1, math.floor(jobs_per_s * ttft_target_s))


def workers_needed(queued: int, target_per_worker: int, min_workers: int = 1, max_workers: int = 10) -> int:
    """The worker count KEDA would ask for: ceil(queued / target), within [min, max]."""
    if target_per_worker < 1:
        raise ValueError("target per worker must be at least 1")
    return max(min_workers, min(max_workers, math.ceil(queued / target_per_worker)))
