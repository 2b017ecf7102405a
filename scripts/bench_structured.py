#!/usr/bin/env python3
"""Structured output vs unconstrained on the in-process engine: tok/s at N users.

Closed loop on one `LlamaCppBackend` (the engine a worker runs, without Redis around it): `users`
jobs stay in flight, each finished job is replaced until `users x jobs_per_user` ran. Both modes
use the same few-shot prompts ("one JSON person per line"), seeds and max_tokens, so the model
writes about the same JSON either way:
- unconstrained: stop at the first newline (one line of text);
- structured: `format` = a small JSON schema (a grammar, checked per pick, see
  backends/llamacpp/sampling.py); the job ends when the JSON value is complete.
The modes alternate for `rounds` rounds (the box may be shared; alternating spreads its load).

    .venv/bin/python scripts/bench_structured.py --users 16 --jobs-per-user 2 --out bench-structured.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import Done, Failed, GenerateRequest, Token  # noqa: E402
from backends.llamacpp import LlamaCppBackend  # noqa: E402
from backends.llamacpp_settings import LlamaCppSettings  # noqa: E402
from ecosystem.local.bench import machine_meta  # noqa: E402

TEXT = {"type": "string", "maxLength": 32}
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "job", "hobbies"],
          "properties": {"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": TEXT,
                         "job": TEXT, "hobbies": {"type": "array", "items": TEXT, "maxItems": 3}}}
# the same prompt for every job (seeds differ), so its KV is reused from the prefix cache
PROMPT = ('One JSON object per line:\n'
          '{"name":"Alice Martin","age":31,"city":"Paris","job":"nurse","hobbies":["chess","running"]}\n'
          '{"name":"Bob Silva","age":42,"city":"Lima","job":"baker","hobbies":["guitar","hiking"]}\n'
          '{"name":"Chen Wei","age":27,"city":"Oslo","job":"engineer","hobbies":["climbing"]}\n')


def request(i: int, structured: bool, max_tokens: int) -> GenerateRequest:
    extra: dict[str, Any] = {"format": PERSON} if structured else {"stop": ["\n"]}
    return GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, temperature=0.7, seed=i, **extra)


def run_mode(engine: LlamaCppBackend, structured: bool, users: int, jobs: int,
             max_tokens: int) -> dict[str, Any]:
    texts: dict[str, str] = {}
    ends: dict[str, Done | Failed] = {}
    admitted = 0
    before = engine.stats()
    t0 = time.perf_counter()
    while len(ends) < jobs:
        while admitted < jobs and engine.free_slots() > 0 and admitted - len(ends) < users:
            engine.admit(f"j{admitted}", request(admitted, structured, max_tokens))
            admitted += 1
        for ev in engine.step(0.0):
            if isinstance(ev, Token):
                texts[ev.job_id] = texts.get(ev.job_id, "") + ev.text
            elif isinstance(ev, Done | Failed):
                ends[ev.job_id] = ev
    seconds = time.perf_counter() - t0
    done = [e for e in ends.values() if isinstance(e, Done)]
    tokens = sum(d.completion_tokens for d in done)
    valid = sum(_is_json_object(texts.get(d.job_id, "")) for d in done)
    return {"mode": "json_schema" if structured else "unconstrained", "jobs": jobs,
            "failed": jobs - len(done),
            "completion_tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2),
            "tokens_per_job": round(tokens / max(1, len(done)), 1), "valid_json": valid,
            "finished_stop": sum(d.finish_reason == "stop" for d in done),
            **{k: _delta(before, engine.stats(), k) for k in COUNTERS}}


COUNTERS = ("grammar_rejections", "prompt_tokens_prefilled", "steps", "decode_seconds")


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    return round(float(after[key]) - float(before[key]), 3)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--jobs-per-user", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="alternating unconstrained/structured rounds")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench-structured.json"))
    args = ap.parse_args()
    engine = LlamaCppBackend(LlamaCppSettings(slots=args.users, n_ctx_per_seq=512), threads=args.threads)
    jobs = args.users * args.jobs_per_user
    runs: list[dict[str, Any]] = []
    try:
        run_mode(engine, False, args.users, args.users, 4)  # warm-up: first-touch of weights and KV
        for r in range(args.rounds):
            for structured in (False, True):
                res = {"round": r, **run_mode(engine, structured, args.users, jobs, args.max_tokens)}
                runs.append(res)
                print(json.dumps(res))
    finally:
        engine.close()
    tok_s = {m: sum(x["tok_s"] for x in runs if x["mode"] == m) / args.rounds
             for m in ("unconstrained", "json_schema")}
    ratio = tok_s["json_schema"] / tok_s["unconstrained"]
    summary = {"users": args.users, "unconstrained_tok_s": round(tok_s["unconstrained"], 2),
               "json_schema_tok_s": round(tok_s["json_schema"], 2), "ratio": round(ratio, 3), "goal": 0.8}
    print(f"{args.users} users: unconstrained {tok_s['unconstrained']:.1f} tok/s, json_schema "
          f"{tok_s['json_schema']:.1f} tok/s -> {ratio:.2f}x (goal >= 0.8x)")
    args.out.write_text(json.dumps({"meta": machine_meta(), "summary": summary, "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
