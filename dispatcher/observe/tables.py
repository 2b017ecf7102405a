"""Rich renderings of a status snapshot and of job history, laid out to fit 80 columns."""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

JOBS_SHOWN = 8  # running jobs listed under the workers table


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def num(value: Any, digits: int = 0) -> str:
    if value is None or value == "":
        return "-"
    try:
        return f"{float(value):,.{digits}f}"
    except (TypeError, ValueError):
        return str(value)


def _table(title: str, *columns: tuple[str, str]) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
              collapse_padding=True, expand=False)
    for name, justify in columns:
        t.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    return t


HEALTH_STYLE = {"ok": "green", "degraded": "yellow", "down": "bold red"}
STATE_STYLE = {"busy": "cyan", "idle": "dim", "draining": "yellow", "waiting for redis": "red"}


def workers_table(snap: dict[str, Any]) -> Table:
    # 8 columns: at 80 columns every one must stay readable, so decode/prefill and cpu/rss share one
    t = _table("workers", ("worker", "left"), ("state", "left"), ("slots", "right"),
               ("tok/s dec/pre", "right"), ("cpu% rss", "right"), ("cpus", "left"), ("backend", "left"),
               ("up", "right"))
    t.columns[0].max_width = 12
    t.columns[6].max_width = 16
    now = snap.get("at") or time.time()
    for w in snap["workers"]:
        health = str(w.get("backend_health") or "ok")
        backend = Text(str(w.get("backend", "?")) + " ")
        backend.append(health, style=HEALTH_STYLE.get(health, ""))
        state = str(w.get("state", "?"))
        node = w.get("numa_node")
        cpus = f"{w.get('cpus') or 'all'}" + (f"/n{node}" if node not in (None, "") else "")
        started = w.get("started_at")
        t.add_row(str(w.get("name")), Text(state, style=STATE_STYLE.get(state, "")),
                  f"{w.get('inflight', 0)}/{w.get('slots', '?')}",
                  f"{num(w.get('tok_s'), 1)}/{num(w.get('tok_s_prefill'))}",
                  f"{num(w.get('cpu_pct'))} {num(w.get('rss_mb'))}M", cpus,
                  backend, duration(now - started if isinstance(started, int | float) else None))
    if not snap["workers"]:
        t.add_row("(no live workers)", *[""] * 7)
    return t


def models_table(snap: dict[str, Any]) -> Table | None:
    """The catalogue models each worker holds now (None when no worker holds any)."""
    rows = [(w, m) for w in snap["workers"] for m in (w.get("backend_stats") or {}).get("models") or []
            if isinstance(m, dict)]
    if not rows:
        return None
    t = _table("models loaded", ("worker", "left"), ("model", "left"), ("RAM", "right"), ("running", "right"),
               ("idle expiry", "right"), ("load", "right"))
    now = snap.get("at") or time.time()
    for w, m in rows:
        expires = m.get("expires_at")
        left = ("pinned" if m.get("pinned") else "never" if not isinstance(expires, int | float)
                else duration(max(0.0, expires - now)))
        t.add_row(str(w.get("name")), str(m.get("name")), f"{num(m.get('memory_mb'))}M",
                  num(m.get("running")), left, f"{num(m.get('load_seconds'), 2)}s")
    return t


def progress_bar(done: int, total: int | None, width: int = 12) -> str:
    if not total:
        return f"{done} tok"
    filled = min(width, round(width * done / total))
    return "█" * filled + "░" * (width - filled) + f" {done}/{total}"


def running_jobs_table(snap: dict[str, Any]) -> Table | None:
    jobs = [(w["name"], j) for w in snap["workers"] for j in (w.get("jobs") or [])]
    if not jobs:
        return None
    jobs.sort(key=lambda wj: -float(wj[1].get("age_s") or 0))
    t = _table(f"running jobs ({len(jobs)})", ("job", "left"), ("worker", "left"), ("progress", "left"),
               ("try", "right"), ("age", "right"))
    t.columns[0].max_width = 14
    for name, j in jobs[:JOBS_SHOWN]:
        bar = progress_bar(int(j.get("tokens") or 0), j.get("max_tokens"))
        t.add_row(str(j.get("id"))[:12], str(name), bar, str(j.get("attempt", 1)), duration(j.get("age_s")))
    if len(jobs) > JOBS_SHOWN:
        t.add_row(f"… {len(jobs) - JOBS_SHOWN} more", "", "", "", "")
    return t


def queues_table(snap: dict[str, Any]) -> Table:
    t = _table(f"queues (pool {snap['pool']})", ("queue", "left"), ("depth", "right"), ("oldest", "right"),
               ("running", "right"), ("failed 1h", "right"), ("finished", "right"), ("failed", "right"))
    for q in snap["queues"]:
        t.add_row(q["queue"], num(q["depth"]), duration(q.get("oldest_age_s")), num(q["running"]),
                  Text(num(q["failed_1h"]), style="red" if q["failed_1h"] else ""), num(q["finished"]),
                  num(q["failed"]))
    return t


def totals_text(snap: dict[str, Any]) -> Text:
    tot = snap["totals"]
    jobs = tot["jobs"]
    text = Text()
    text.append(f"{tot['workers']} workers", style="bold")
    text.append(f" · slots busy {tot['busy']}/{tot['slots']} · {num(tot['tok_s'], 1)} tok/s"
                f" (prefill {num(tot['tok_s_prefill'])})\n")
    text.append(f"queued {tot['queued']} · running {tot['running']} · failed in the last hour "
                f"{tot['failed_1h']}\n")
    text.append(f"since start: {num(tot['tokens_generated'])} tokens generated, "
                f"{num(tot['prompt_tokens'])} prompt ({num(tot['cached_tokens'])} cached"
                f"{_from_store(tot)}); jobs "
                f"{jobs['finished']} finished, {jobs['failed']} failed, {jobs['cancelled']} cancelled",
                style="dim")
    return text


def _from_store(tot: dict[str, Any]) -> str:
    """Of the cached tokens, those read from the host's KV store (a store on: restores happened)."""
    n = int(tot.get("store_restores") or 0)
    if not n:
        return ""
    return (f", {num(tot['store_restored_tokens'])} from the KV store in {n} restores,"
            f" {num(tot['store_restore_ms'])} ms")


def status_view(snap: dict[str, Any], header: str | None = None) -> RenderableType:
    parts: list[RenderableType] = []
    if header:
        parts.append(Text(header, style="bold"))
    parts.append(workers_table(snap))
    parts += [t for t in (models_table(snap), running_jobs_table(snap)) if t is not None]
    parts += [queues_table(snap), totals_text(snap)]
    return Group(*parts)


# -- job history ---------------------------------------------------------------------------------


def _ms(value: Any) -> str:
    if value is None:
        return "-"
    v = float(value)
    return f"{v:,.0f} ms" if v < 10_000 else f"{v / 1000:,.1f} s"


def jobs_table(records: list[dict[str, Any]], title: str) -> Table:
    t = _table(title, ("job", "left"), ("state", "left"), ("worker", "left"), ("try", "right"),
               ("ttft", "right"), ("total", "right"), ("prompt / error", "left"))
    t.columns[6].max_width = 26
    now = time.time()
    for r in records:
        end = r.get("end") or {}
        attempts = r.get("attempts") or []
        last = attempts[-1] if attempts else {}
        timings = end.get("timings") or {}
        params = r.get("params") or {}
        what = end.get("error") or params.get("prompt") or params.get("last_message") or ""
        state = str(r.get("state") or "?")
        total = timings.get("total_ms")
        if total is None and state == "queued":
            total_text = duration(r.get("enqueued_at") and now - r["enqueued_at"])
        else:
            total_text = _ms(total)
        t.add_row(str(r["id"])[:12], Text(state, style="red" if state == "failed" else ""),
                  str(end.get("worker") or last.get("worker") or "-"),
                  str(end.get("attempt") or (last.get("attempt") if last else "-")),
                  _ms(timings.get("ttft_ms")), total_text, str(what).replace("\n", " "))
    if not records:
        t.add_row("(none)", *[""] * 6)
    return t


def job_view(record: dict[str, Any]) -> RenderableType:
    end = record.get("end") or {}
    info = Table.grid(padding=(0, 2))
    info.add_column(style="bold", no_wrap=True)
    info.add_column()
    info.add_row("job", str(record["id"]))
    info.add_row("state", str(record.get("state")))
    info.add_row("queue", str(record.get("queue")))
    for k, v in (record.get("params") or {}).items():
        info.add_row(f"  {k}", str(v))
    if end:
        info.add_row("worker", f"{end.get('worker')} ({end.get('backend') or '?'})")
        t = end.get("timings") or {}
        info.add_row("timings", f"queue wait {_ms(t.get('queue_ms'))}, ttft {_ms(t.get('ttft_ms'))}, decode "
                                f"{num(t.get('tokens_per_s'), 1)} tok/s, total {_ms(t.get('total_ms'))}")
        usage = end.get("usage") or {}
        if usage:
            info.add_row("tokens", f"{usage.get('prompt_tokens')} prompt ({usage.get('cached_tokens', 0)} "
                                   f"cached), {usage.get('completion_tokens')} generated "
                                   f"({end.get('finish_reason')})")
        if end.get("error"):
            info.add_row("error", Text(str(end["error"]), style="red"))
    at = _table("attempts", ("#", "right"), ("worker", "left"), ("backend", "left"), ("started", "left"),
                ("lost because", "left"))
    at.columns[4].overflow = "fold"
    for a in record.get("attempts") or []:
        lost = a.get("lost") or {}
        started = a.get("started_at")
        at.add_row(str(a["attempt"]), str(a.get("worker", "-")), str(a.get("backend", "-")),
                   time.strftime("%H:%M:%S", time.localtime(started)) if started else "-",
                   str(lost.get("reason", "")))
    return Group(info, at)
