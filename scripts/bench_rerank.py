#!/usr/bin/env python3
"""Rerank throughput on the in-process engine: documents/s of one request of `--docs` documents
(scored `rerank_batch` at a time on the query's prefix, prefilled once) against the same
documents as that many separate scoring requests (one document a call, the whole prompt
prefilled each time, as a client without a rerank route would ask: no prefix held between them).

The two run in ABBA order (`--rounds`, reversed every other round): the box may be shared, so
only ratios within a round mean anything; the median ratio is the headline. Each run's scores
are compared with the other's (the largest difference is printed: the model's rounding with
how decodes are cut and batched: up to ~0.08, docs/gateway.md).

    .venv/bin/python scripts/bench_rerank.py --docs 100 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from backends.contract.rerank import DEFAULT_INSTRUCTION
from backends.llamacpp.engine import LlamaCppBackend
from backends.llamacpp_settings import LlamaCppSettings

QUERY = "Which city is the capital of France?"
TOPICS = ("Bake the bread for 40 minutes.", "The stock market fell on Monday.",
          "Cats sleep most of the day.", "Water boils at 100 degrees Celsius.", "The train leaves at noon.",
          "Paris is the capital of France.")


def together(engine: LlamaCppBackend, documents: list[str]) -> list[float]:
    """One request: the engine's calls in a row on the held prefix, as the worker makes them."""
    scored: list[float] = []
    while len(scored) < len(documents):
        batch = documents[len(scored):len(scored) + engine.score_batch]
        scored += engine.score(QUERY, DEFAULT_INSTRUCTION, batch).relevance
    return scored


def separately(engine: LlamaCppBackend, documents: list[str]) -> list[float]:
    """A request a document, each prefilling its whole prompt."""
    scored: list[float] = []
    for doc in documents:
        assert engine._scoring is not None
        engine._scoring.held = []  # nothing shared between separate requests
        scored += engine.score(QUERY, DEFAULT_INSTRUCTION, [doc]).relevance
    return scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    documents = [f"Note {i}: {TOPICS[i % len(TOPICS)]}" for i in range(args.docs)]
    engine = LlamaCppBackend(LlamaCppSettings(slots=1), threads=args.threads)
    engine.score(QUERY, DEFAULT_INSTRUCTION, documents[:1])  # the scoring context, made once
    ratios = []
    try:
        for r in range(args.rounds):
            runs = [("together", together), ("separately", separately)]
            rates: dict[str, float] = {}
            scores: dict[str, list[float]] = {}
            for name, run in runs if r % 2 == 0 else runs[::-1]:
                assert engine._scoring is not None
                engine._scoring.held = []
                started = time.perf_counter()
                scores[name] = run(engine, documents)
                rates[name] = len(documents) / (time.perf_counter() - started)
            ratios.append(rates["together"] / rates["separately"])
            spread = max(abs(a - b) for a, b in zip(scores["together"], scores["separately"], strict=True))
            print(f"round {r + 1}: together {rates['together']:.1f} docs/s, separately "
                  f"{rates['separately']:.1f} docs/s, ratio {ratios[-1]:.2f}x, largest score difference "
                  f"{spread:.3f}")
    finally:
        engine.close()
    print(f"median ratio {statistics.median(ratios):.2f}x over {args.rounds} rounds of {args.docs} documents")


if __name__ == "__main__":
    main()
