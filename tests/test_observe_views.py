"""The live views of the fleet: `fleet status --watch` under tmux, the web dashboard in headless
Chromium (real redis-server, 2 `fleet worker` processes on the real model), and the Grafana
dashboard's metric names against the exporter's output."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from redis import Redis
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from dispatcher import Fleet
from dispatcher.observe.dashboard import dashboard_app
from ecosystem.local.processes import free_port
from tests.harness import ROOT, wait_for
from tests.observe_helpers import chromium, cli_env, collect


class Load(threading.Thread):
    """Keeps `n` jobs in flight until stopped, so the views have something to show."""

    def __init__(self, redis_url: str, n: int = 4, max_tokens: int = 24) -> None:
        super().__init__(daemon=True)
        self.fleet = Fleet(redis_url)
        self.n, self.max_tokens = n, max_tokens
        self.halt = threading.Event()
        self.done = 0

    def run(self) -> None:
        while not self.halt.is_set():
            jobs = [self.fleet.submit(prompt=f"Say something about number {i}.", max_tokens=self.max_tokens)
                    for i in range(self.n)]
            for job in jobs:
                job.result(timeout=300)
                self.done += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=300)


@pytest.mark.model
@pytest.mark.timeout(600)
def test_status_watch_redraws_in_place_under_tmux(redis_url: str, workers, tmp_path: Path) -> None:
    workers.start("w1", backend__slots=4)
    workers.start("w2", backend__slots=4)
    sock = f"fleet-watch-{free_port()}"
    env = cli_env(redis_url)
    cmd = " ".join([f"{k}={v!r}" for k, v in env.items() if k.startswith(("FLEET_", "PATH"))]
                   # the pane's size, also as LINES/COLUMNS: a detached tmux session may report 80x24
                   # to the program for a moment, and rich keeps the Live region to that height
                   + ["LINES=45", "COLUMNS=80"]
                   + [sys.executable, "-m", "ecosystem.cli", "status", "--watch", "--interval", "0.5"])
    tmux = ["tmux", "-L", sock]
    subprocess.run([*tmux, "new-session", "-d", "-s", "watch", "-x", "80", "-y", "45", f"cd {ROOT} && {cmd}"],
                   check=True)

    def screen_showing(*words: str) -> str | None:
        shot = subprocess.run([*tmux, "capture-pane", "-p", "-t", "watch"], capture_output=True, text=True,
                              check=True).stdout
        return shot if all(w in shot for w in words) else None

    try:
        idle = wait_for(lambda: screen_showing("w1", "w2", "idle"), 60, "the watch to show both idle workers",
                        interval=0.3)
        assert "running jobs" not in idle and "jobs 0 finished" in idle
        load = Load(redis_url, n=6, max_tokens=32)
        load.start()
        busy = wait_for(lambda: screen_showing("running jobs", "busy"), 120, "the watch to show running jobs",
                        interval=0.3)
        assert "█" in busy or "░" in busy  # a job's progress bar
        load.stop()
        def all_done() -> str | None:  # the count and the empty running list land on separate beats
            shot = screen_showing(f"jobs {load.done} finished")
            return shot if shot and "running jobs" not in shot else None

        finished = wait_for(all_done, 60, "the watch to count the finished jobs, none running", interval=0.3)
        for shot in (idle, busy, finished):
            assert max(len(line) for line in shot.splitlines()) <= 80
            assert shot.count("workers") == 2, shot  # redrawn in place, not scrolled: one header + totals
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)


@pytest.mark.model
@pytest.mark.timeout(600)
def test_dashboard_in_headless_chromium_shows_workers_and_a_chart(redis_url: str, workers,
                                                                   tmp_path: Path) -> None:
    workers.start("w1", backend__slots=4)
    workers.start("w2", backend__slots=4)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "ecosystem.cli", "dashboard", "--port", str(port)],
                              env=cli_env(redis_url), cwd=ROOT, stderr=subprocess.DEVNULL)
    load = Load(redis_url, n=6, max_tokens=32)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: _get(url), 30, "the dashboard to answer")
        load.start()
        wait_for(lambda: sum(w["inflight"] for w in httpx.get(url + "api/status").json()["workers"]) > 0, 120,
                 "jobs in flight", interval=0.2)
        # the workers report throughput on their next beat (a job may still be prefilling on a busy box);
        # virtual time runs the page's polls within a real second or so, so they must already see it
        wait_for(lambda: httpx.get(url + "api/status").json()["totals"]["tok_s"] > 0, 60,
                 "a worker to report tokens per second", interval=0.2)
        # virtual time lets the page poll several times before the DOM is dumped
        out = chromium("--virtual-time-budget=6000", "--dump-dom", url, profile=tmp_path / "profile")
        dom = out.stdout
        assert 'data-worker="w1"' in dom and 'data-worker="w2"' in dom, out.stderr[-2000:]
        chart = re.search(r'<svg id="chart-toks"[^>]*>', dom)
        assert chart is not None
        assert float(re.search(r'data-max="([\d.]+)"', chart.group(0)).group(1)) > 0  # type: ignore[union-attr]
        assert int(re.search(r'data-samples="(\d+)"', chart.group(0)).group(1)) >= 2  # type: ignore[union-attr]
        points = re.findall(r'<polyline data-series="total"[^>]*points="([^"]+)"', dom)
        assert points and len(points[0].split()) >= 2
        assert "queues" in dom and "llm:default" in dom
        shot = tmp_path / "dashboard.png"
        chromium("--virtual-time-budget=6000", "--window-size=1200,1500", f"--screenshot={shot}", url,
                 profile=tmp_path / "profile2")
        assert shot.exists() and shot.stat().st_size > 10_000
        if target := _screenshot_target():
            shutil.copy(shot, target)
    finally:
        load.stop()
        server.terminate()
        server.wait(10)


def _get(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _screenshot_target() -> Path | None:
    """FLEET_DOCS_SCREENSHOT=1 refreshes docs/dashboard.png from this run."""
    import os

    return ROOT / "docs" / "dashboard.png" if os.environ.get("FLEET_DOCS_SCREENSHOT") else None


def test_dashboard_mounts_under_a_prefix(redis: Redis) -> None:
    app = Starlette(routes=[Mount("/dashboard", app=dashboard_app(redis, "llm"))])
    with TestClient(app) as client:
        page = client.get("/dashboard/")
        assert page.status_code == 200 and '<base href="/dashboard/">' in page.text
        assert client.get("/dashboard/static/dashboard.js").status_code == 200
        assert client.get("/dashboard/api/status").json()["queues"][0]["queue"] == "llm:high"
        assert client.get("/dashboard/api/jobs?kind=nope").status_code == 400
        assert client.get("/dashboard/api/job/missing").status_code == 404


def test_grafana_dashboard_uses_only_exported_metric_names(redis_url: str, redis: Redis, workers) -> None:
    workers.start("w-fake", backend__type="fake", backend__slots=2)
    Fleet(redis_url).submit(prompt="hello", max_tokens=4).result(timeout=60)
    exported = {name for name, _labels in collect(redis)}
    dashboard = json.loads((ROOT / "ecosystem" / "grafana" / "llama-fleet.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][0]["query"]["query"])
    used = {name for e in exprs for name in re.findall(r"\bllama_fleet_[a-z_]+", e)}
    assert len(used) >= 20
    assert used <= exported, f"not exported: {sorted(used - exported)}"
