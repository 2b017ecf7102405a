#!/usr/bin/env python3
"""Sampled jobs on the in-process engine: top-k chains fed the tokens near the best logit
(`TopCandidates`, the default) against `llama_sampler_sample` over the whole vocabulary.

Closed loop on one `LlamaCppBackend` (no Redis): `users` sampled jobs (temperature 0.8, top-k 40,
a seed each) stay in flight until `jobs` ran. The two paths pick the same tokens (see
tests/test_engine_sampling.py), so they run the same work; they alternate A B B A ... on one
loaded model, after a warm-up run.

    .venv/bin/python scripts/bench_sampling.py --threads 2 --users 16 --jobs 96 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import Done, Failed, GenerateRequest  # noqa: E402
from backends.llamacpp import LlamaCppBackend, sampling  # noqa: E402
from backends.llamacpp_settings import LlamaCppSettings  # noqa: E402
from ecosystem.local.bench import machine_meta  # noqa: E402

NEAR_BEST = sampling.TopCandidates.fill


def run(engine: LlamaCppBackend, path: str, tag: str, users: int, jobs: int, tokens: int) -> dict[str, Any]:
    # "vocabulary": TopCandidates steps aside, every row goes through llama_sampler_sample
    sampling.TopCandidates.fill = NEAR_BEST if path == "near-best" else lambda self, logits, k: None  # type: ignore[method-assign]
    admitted = ended = generated = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while ended < jobs:
        while admitted < jobs and engine.free_slots() > 0 and admitted - ended < users:
            request = GenerateRequest(prompt=f"Story {admitted}: the", max_tokens=tokens, temperature=0.8,
                                      top_k=40, seed=admitted)
            engine.admit(f"{tag}-{admitted}", request)
            admitted += 1
        for ev in engine.step(0.0):
            if isinstance(ev, Done | Failed):
                ended += 1
                generated += ev.completion_tokens if isinstance(ev, Done) else 0
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"path": path, "tok_s": generated / wall, "cpu_ms_per_token": cpu / generated * 1e3,
            "tokens": generated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-sampling.json"))
    a = ap.parse_args()
    engine = LlamaCppBackend(LlamaCppSettings(slots=a.users, n_ctx_per_seq=512), threads=a.threads)
    run(engine, "vocabulary", "warm", a.users, a.jobs, a.tokens)
    order = [p for i in range(a.pairs) for p in (("near-best", "vocabulary") if i % 2 == 0 else
                                                 ("vocabulary", "near-best"))]
    runs = [run(engine, path, f"r{i}", a.users, a.jobs, a.tokens) for i, path in enumerate(order)]
    engine.close()
    median = {}
    for p in ("near-best", "vocabulary"):
        mine = [r for r in runs if r["path"] == p]
        median[p] = statistics.median(r["tok_s"] for r in mine)
        per_run = "; ".join(f"{r['tok_s']:.1f} tok/s, {r['cpu_ms_per_token']:.2f} CPU ms/token" for r in mine)
        print(f"{p:>10}: median {median[p]:.1f} tok/s   ({per_run})")
    ratio = median["near-best"] / median["vocabulary"]
    print(f"near-best / vocabulary, median tok/s: {ratio:.3f}x")
    config = vars(a) | {"out": str(a.out)}
    report = {"meta": machine_meta(), "config": config, "runs": runs, "ratio_tok_s": ratio}
    a.out.write_text(json.dumps(report, indent=1))
    print(f"JSON: {a.out}")


if __name__ == "__main__":
    main()
