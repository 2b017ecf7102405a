"""Pure pieces of observability: histogram buckets, restart labels, the history record shape,
the bench HTML report."""

from __future__ import annotations

from pathlib import Path

from backends.contract import observe_schema
from dispatcher.observe import history
from ecosystem.local.bench_html import write_html
from ecosystem.local.bench_load import Sample
from ecosystem.local.bench_report import FLEET, PEER, Run, summaries


def test_buckets_count_each_observation_once_and_cumulate_for_prometheus() -> None:
    assert observe_schema.bucket_field("ttft", 0.01) == "0.01"  # le: the bound itself counts
    assert observe_schema.bucket_field("ttft", 0.011) == "0.025"
    assert observe_schema.bucket_field("ttft", 99.0) == "+Inf"
    raw = {"0.01": "2", "0.025": "1", "+Inf": "3", "sum": "40.5"}
    buckets, total = observe_schema.cumulative_buckets("ttft", raw)
    assert buckets[0] == ("0.01", 2.0) and buckets[1] == ("0.025", 3.0)
    assert buckets[-1] == ("+Inf", 6.0) and total == 40.5
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)


def test_restart_reasons_map_to_few_labels() -> None:
    assert observe_schema.restart_kind("worker w-1 died (its heartbeat expired)") == "worker_died"
    assert observe_schema.restart_kind("the previous process named w-1 died while running it") == (
        "worker_died")
    assert observe_schema.restart_kind("outage buffer full") == "outage"
    assert observe_schema.restart_kind("worker stopped") == "shutdown"
    assert observe_schema.restart_kind("backend unavailable: connection refused") == "engine"
    assert {observe_schema.restart_kind(r) for r in ("x", "y")} <= set(observe_schema.RESTART_KINDS)


def test_history_keeps_prompts_short_and_attempts_in_order() -> None:
    params = observe_schema.short_params({"prompt": "x" * 1000, "max_tokens": 8})
    assert len(params["prompt"]) == observe_schema.PROMPT_SHOWN and params["max_tokens"] == 8
    chat = observe_schema.short_params({"messages": [{"role": "user", "content": "hi"}] * 3})
    assert chat == {"messages": 3, "last_message": "hi"}
    lost = b'{"reason": "worker a died", "kind": "worker_died"}'
    raw = {b"queue": b"llm:default", b"state": b"finished", b"attempt:2": b'{"worker": "b"}',
           b"attempt:1": b'{"worker": "a"}', b"restart:1": lost,
           b"end": b'{"outcome": "finished"}', b"attempt:x": b"ignored"}
    record = history.decode("j1", raw)
    assert [a["worker"] for a in record["attempts"]] == ["a", "b"]
    assert record["attempts"][0]["lost"]["reason"] == "worker a died" and "lost" not in record["attempts"][1]
    assert record["end"] == {"outcome": "finished"} and record["state"] == "finished"


def test_bench_html_report_plots_the_fleet_against_each_peer(tmp_path: Path) -> None:
    def run(users: int, role: str, system: str, tokens: int) -> Run:
        # CPU seconds too: the fourth plot is CPU s per 1,000 tokens
        return Run(users, role, system, 0, 2.0, [Sample(0.1 * users, 1.0, tokens)] * users, {"all": 1.5})

    rows = summaries([run(u, r, s, t) for u in (1, 4, 16) for r, s, t in
                      ((FLEET, "fleet (llama-cpp)", 40), (PEER, f"llama-server -np {u}", 30))])
    out = tmp_path / "bench.html"
    write_html(out, rows, "bench <test>", {"cores": 2, "config": {"users": [1, 4, 16]}})
    page = out.read_text()
    assert page.count("<svg") == 4 and "bench &lt;test&gt;" in page
    assert page.count('data-series="fleet (llama-cpp)"') == 4
    assert page.count('data-series="llama-server"') == 4
    assert "1.33x" in page  # fleet/peer tok/s ratio in the table
