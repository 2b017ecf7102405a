#!/usr/bin/env python3
"""How much of the worker loop's time a flood of big /tokenize jobs takes, beside a stream.

A FleetWorker on the real engine in this process (a private redis-server), one streaming job,
then `--jobs` tokenize jobs of `--chars` characters of prose. Every turn of the loop is split in
two: the engine's step (the decode, CPU-bound: slowed by whatever else the machine runs) and the
rest, the loop's own work (claims, starting jobs, text jobs, writing endings), which is what a
text job must not take: before text jobs ran on their own thread, one turn held every
tokenization of the jobs it started (seconds). Prints both, before the flood and during it.

    .venv/bin/python scripts/probe_text_flood.py --jobs 4 --chars 1000000
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import Event  # noqa: E402
from backends.contract.keys import job_key  # noqa: E402
from backends.contract.text_ops import text_fields  # noqa: E402
from backends.llamacpp import LlamaCppBackend  # noqa: E402
from backends.llamacpp_settings import LlamaCppSettings  # noqa: E402
from dispatcher import Fleet  # noqa: E402
from ecosystem.local.processes import RedisServer  # noqa: E402
from worker.inprocess import worker_client  # noqa: E402
from worker.serving.loop import FleetWorker  # noqa: E402
from worker.settings import FleetSettings  # noqa: E402

WORDS = ["the", "tokenizer", "reads", "every", "word", "über", "naïve", "日本語", "\n", "Hello,", "world.",
         "straße", "example", "quickly", "résumé", "and", "of", "system", "answer"]


def prose(chars: int, seed: int) -> str:
    words = [WORDS[(i * 7919 + seed * 104729) % len(WORDS)] for i in range(chars // 3)]
    return " ".join(words)[:chars]


def report(label: str, turns: list[tuple[float, float]]) -> None:
    whole = [t for t, _ in turns]
    own = [t - step for t, step in turns]
    print(f"{label:>6}: {len(turns)} turns; turn median {statistics.median(whole) * 1000:.0f} ms, "
          f"longest {max(whole) * 1000:.0f} ms; the loop's own part median "
          f"{statistics.median(own) * 1000:.1f} ms, longest {max(own) * 1000:.0f} ms")


@click.command()
@click.option("--jobs", default=4, show_default=True, help="tokenize jobs submitted at once")
@click.option("--chars", default=1_000_000, show_default=True, help="characters each")
@click.option("--calm", default=5.0, show_default=True, help="seconds of the stream alone first")
@click.option("--threads", default=2, show_default=True)
def main(jobs: int, chars: int, calm: float, threads: int) -> None:
    with RedisServer.start(Path(tempfile.mkdtemp(prefix="probe-redis-"))) as redis_server:
        # a context that admits `chars` characters (32 per token), so the texts are tokenized
        n_ctx = max(4096, -(-chars // 32 // 256) * 256)
        settings = FleetSettings(redis_url=redis_server.url, name="probe", backend={
            "type": "llama-cpp", "slots": jobs + 1, "n_ctx_per_seq": n_ctx})
        assert isinstance(settings.backend, LlamaCppSettings)
        engine = LlamaCppBackend(settings.backend, threads=threads)
        worker = FleetWorker(settings, engine, worker_client(redis_server.url), "probe")
        stepped = [0.0]
        step = engine.step

        def timed_step(timeout: float = 0.0) -> list[Event]:
            started = time.perf_counter()
            try:
                return step(timeout)
            finally:
                stepped[0] += time.perf_counter() - started

        engine.step = timed_step  # type: ignore[method-assign]
        fleet = Fleet(redis_server.url)

        def turns_until(done: Callable[[], bool]) -> list[tuple[float, float]]:
            out = []
            while not done():
                stepped[0] = 0.0
                started = time.perf_counter()
                worker.run_once()
                out.append((time.perf_counter() - started, stepped[0]))
            return out

        stream = fleet.submit(prompt="Once upon a time", max_tokens=8000, ignore_eos=True, temperature=0)
        calm_until = time.monotonic() + calm
        report("calm", turns_until(lambda: time.monotonic() > calm_until))
        started = time.monotonic()
        ids = [fleet.submit(**text_fields("tokenize", content=prose(chars, seed))).id for seed in range(jobs)]
        ended = {b"finished", b"failed"}
        report("flood", turns_until(lambda: all(fleet.redis.hget(job_key(i), "status") in ended
                                                for i in ids)))
        took = time.monotonic() - started
        finished = sum(fleet.redis.hget(job_key(i), "status") == b"finished" for i in ids)
        print(f"{jobs} x {chars:,} characters tokenized in {took:.1f} s beside the stream "
              f"({finished} finished, {jobs - finished} failed)")
        stream.cancel()
        worker.texts.close()
        engine.close()


if __name__ == "__main__":
    main()
