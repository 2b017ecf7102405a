"""What one more worker costs in memory: USS/PSS per worker for 1 vs 2 workers on this host.

    scripts/measure-memory [--counts 1,2] [--jobs 4] [--n-ctx N] [--slots N] [--env FLEET_K=V] [--json F]

For each count it runs `fleet up --daemon --workers N` (a private redis-server on a free port, the
real model, this repo's worker-config.json plus FLEET_* overrides), lets every worker serve at least
--jobs jobs, then reads each worker's memory with psutil (memory_full_info: RSS, PSS, USS) and
/proc/<pid>/smaps split into the model's file mapping, other files (libraries) and anonymous
memory; then `fleet down`. llama.cpp's own buffer sizes (KV cache, CPU_REPACK copies of weights,
compute and output buffers) come from its log, captured while loading the same engine with the
same settings in a throwaway process.

The goal being checked: weights are shared through mmap, so an extra worker costs at
most its KV cache + 60 MiB of USS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from backends.contract.connect import redis_from_url  # noqa: E402
from dispatcher import Fleet  # noqa: E402
from dispatcher import status as fleet_status  # noqa: E402

MIB = 2**20
GOAL_MIB = 60.0  # USS beyond the KV cache that one more worker may cost
BUFFER = re.compile(r"(CPU_REPACK model|CPU_Mapped model|KV|output|compute) buffer size =\s*([\d.]+) MiB")
KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")

# Loads the engine exactly as `fleet worker` would (same settings, same constructor) with
# llama.cpp's log let through (workers keep only errors); prints the log, then the process's
# private memory (USS without the model file's pages) after the worker's imports and after the load.
ENGINE_PROBE = """
import sys
import llama_cpp as ll
import backends.llamacpp.model as loaded_model
import ecosystem.cli, worker.main
from backends.registry import make_backend
from worker.settings import load_settings

@ll.llama_log_callback
def everything(level, text, user_data):
    sys.stdout.write(text.decode(errors="replace"))

def private():
    total, model = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            model = fields[-1].endswith(".gguf")
        elif fields[0] in ("Private_Clean:", "Private_Dirty:") and not model:
            total += int(fields[1]) * 1024
    return total

imported = private()
loaded_model._quiet_log = everything
make_backend(load_settings().backend, threads=1)
print(f"\\nUSS {imported} {private()}")
"""


def fleet_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ecosystem.cli", *args]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_buffers(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_PROBE], env=env, cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    sizes: dict[str, float] = {}
    for kind, mib in BUFFER.findall(out):
        key = {"CPU_REPACK model": "repack", "CPU_Mapped model": "model_mapped"}.get(kind, kind.lower())
        sizes[key] = round(sizes.get(key, 0.0) + float(mib), 2)  # KV: SWA + non-SWA caches
    caches = KV_LINE.findall(out)
    cells = int(caches[0][1]) if caches else 0
    layers = sum(int(c[2]) for c in caches)
    per_cell = sizes.get("kv", 0.0) * MIB / cells if cells else 0.0
    imported, loaded = (int(x) / MIB for x in out.rsplit("USS ", 1)[1].split())
    return {
        "buffers_mib": sizes,
        "kv_cells": cells,
        "kv_layers": layers,
        "kv_bytes_per_cell": round(per_cell),
        "imports_uss_mib": round(imported, 1),
        "engine_load_uss_mib": round(loaded - imported, 1),
    }


def smaps(pid: int) -> dict[str, dict[str, float]]:
    """Rss / Pss / Private (= this process's share of USS) by kind of mapping, in MiB."""
    kinds: dict[str, dict[str, float]] = {}
    kind = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
            path = fields[5] if len(fields) > 5 else ""
            kind = "model" if path.endswith(".gguf") else "files" if path.startswith("/") else "anon"
            continue
        key = fields[0].rstrip(":")
        if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
            name = "private" if key.startswith("Private") else key.lower()
            row = kinds.setdefault(kind, {"rss": 0.0, "pss": 0.0, "private": 0.0})
            row[name] += int(fields[1]) * 1024 / MIB
    return {k: {n: round(v, 1) for n, v in row.items()} for k, row in sorted(kinds.items())}


def measure(pid: int) -> dict[str, Any]:
    info = psutil.Process(pid).memory_full_info()
    return {
        "rss_mib": round(info.rss / MIB, 1),
        "pss_mib": round(info.pss / MIB, 1),
        "uss_mib": round(info.uss / MIB, 1),
        "swap_mib": round(info.swap / MIB, 1),
        "by_mapping": smaps(pid),
    }


def serve(url: str, names: list[str], jobs: int, max_tokens: int) -> dict[str, dict[str, Any]]:
    """Submit rounds of jobs until every worker has finished at least `jobs`; their status rows."""
    producer = Fleet(url)
    redis = redis_from_url(url)
    for rnd in range(20):
        batch = [
            producer.submit(prompt=f"Round {rnd}, story {i}: once upon a time", max_tokens=max_tokens, seed=i)
            for i in range(2 * len(names))
        ]
        for job in batch:
            job.result(timeout=300)
        time.sleep(1.5)  # a heartbeat publishes jobs_done
        rows = {str(w["name"]): w for w in fleet_status.workers(redis)}
        if all(int(rows[n]["jobs_done"]) >= jobs for n in names):
            return {n: rows[n] for n in names}
    raise RuntimeError(f"after 20 rounds some worker had served fewer than {jobs} jobs: {rows}")


def run_fleet(count: int, env: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"fleet-mem{count}-"))
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**env, "FLEET_REDIS_URL": url}
    up = ["up", "--daemon", "--workers", str(count), "--run-dir", str(run_dir)]
    subprocess.run(fleet_cmd(*up), env=env, cwd=REPO, check=True, capture_output=True)
    try:
        names = [f"worker-{i}" for i in range(count)]
        rows = serve(url, names, args.jobs, args.max_tokens)
        out = []
        for name in names:
            pid = int(rows[name]["pid"])
            out.append(
                {
                    "workers": count,
                    "name": name,
                    "pid": pid,
                    "cpus": rows[name]["cpus"],
                    "jobs_done": int(rows[name]["jobs_done"]),
                    **measure(pid),
                }
            )
        return out
    finally:
        subprocess.run(fleet_cmd("down", "--run-dir", str(run_dir)), env=env, check=True, capture_output=True)


def pss_without_model(row: dict[str, Any]) -> float:
    return float(row["pss_mib"]) - float(row["by_mapping"].get("model", {}).get("pss", 0.0))


def report(engine: dict[str, Any], runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    buf = engine["buffers_mib"]
    kv = float(buf.get("kv", 0.0))
    print(
        f"llama.cpp buffers per worker (MiB): KV {kv} ({engine['kv_cells']} cells x "
        f"{engine['kv_bytes_per_cell'] / 1024:.1f} KiB, {engine['kv_layers']} layers, f16), "
        f"CPU_REPACK {buf.get('repack', 0)} (weights repacked into anonymous memory), "
        f"compute {buf.get('compute', 0)}, output {buf.get('output', 0)}, "
        f"model mmap {buf.get('model_mapped', 0)}"
    )
    other = engine["engine_load_uss_mib"] - kv - float(buf.get("repack", 0))
    print(
        f"USS (without the model file) of a process loading the same engine: "
        f"{engine['imports_uss_mib']} MiB after the worker's "
        f"imports, +{engine['engine_load_uss_mib']} MiB for the engine (KV {kv} + repack "
        f"{buf.get('repack', 0)} + {other:.1f} other: vocabulary/tokenizer, touched compute/output buffers)"
    )
    print("model Rss/Pss/priv: the model's file mapping; Pss < Rss when other processes map it too")
    head = f"{'workers':>7} {'worker':<9} {'cpus':<5} {'jobs':>4} {'RSS':>7} {'PSS':>7} {'USS':>7}"
    head += f" {'model Rss/Pss/priv':>20} {'anon priv':>9} {'libs priv':>9}"
    print(head)
    for count, rows in runs.items():
        for r in rows:
            m = r["by_mapping"].get("model", {"rss": 0, "pss": 0, "private": 0})
            model = f"{m['rss']:.0f}/{m['pss']:.0f}/{m['private']:.0f}"
            anon = r["by_mapping"].get("anon", {}).get("private", 0.0)
            libs = r["by_mapping"].get("files", {}).get("private", 0.0)
            print(
                f"{count:>7} {r['name']:<9} {r['cpus']:<5} {r['jobs_done']:>4} {r['rss_mib']:>7.1f} "
                f"{r['pss_mib']:>7.1f} {r['uss_mib']:>7.1f} {model:>20} {anon:>9.1f} {libs:>9.1f}"
            )
    summary: dict[str, Any] = {"engine": engine, "runs": runs, "goal_mib": None, "verdict": None}
    if 1 in runs and 2 in runs:
        # the model's pages are in the page cache once, however many processes map them: leave
        # them out, or the sum moves with whatever else on this host maps the same file
        pss1 = sum(pss_without_model(r) for r in runs[1])
        pss2 = sum(pss_without_model(r) for r in runs[2])
        extra = round(pss2 - pss1, 1)
        goal = round(kv + GOAL_MIB, 1)
        worst = max(r["uss_mib"] for r in runs[2])
        ok = worst <= goal and extra <= goal
        summary.update(extra_worker_pss_mib=extra, max_uss_with_2_mib=worst, goal_mib=goal, verdict=ok)
        print(
            f"total PSS without the shared model mapping: 1 worker {pss1:.1f} MiB, 2 workers "
            f"{pss2:.1f} MiB -> the extra worker costs {extra:.1f} MiB; "
            f"USS per worker with 2: max {worst:.1f} MiB"
        )
        print(
            f"goal: <= KV + {GOAL_MIB:.0f} MiB = {goal:.1f} MiB -> {'met' if ok else 'NOT met'} "
            f"(beyond KV: {worst - kv:.1f} MiB USS, {extra - kv:.1f} MiB PSS)"
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--counts", default="1,2", help="worker counts to compare (default 1,2)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs each worker serves before measuring")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--n-ctx", type=int, help="KV cells per worker (FLEET_BACKEND__N_CTX)")
    parser.add_argument("--slots", type=int, help="sequences per worker (FLEET_BACKEND__SLOTS)")
    parser.add_argument("--env", action="append", default=[], help="FLEET_KEY=VALUE for the workers")
    parser.add_argument("--json", type=Path, default=REPO / "bench-results" / "memory.json")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(FLEET_CONFIG=str(REPO / "worker-config.json"), PYTHONPATH=str(REPO))
    if args.n_ctx:
        env["FLEET_BACKEND__N_CTX"] = str(args.n_ctx)
    if args.slots:
        env["FLEET_BACKEND__SLOTS"] = str(args.slots)
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    engine = engine_buffers(env)
    runs = {n: run_fleet(n, env, args) for n in (int(c) for c in args.counts.split(","))}
    summary = report(engine, runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
