"""Helpers for the observability tests: the `fleet` CLI as a subprocess, Prometheus scrapes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from tests.harness import ROOT, worker_env

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def cli_env(redis_url: str) -> dict[str, str]:
    env = worker_env(redis_url, "cli")
    env.pop("FLEET_NAME", None)
    env["COLUMNS"] = "80"
    return env


def fleet(redis_url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "ecosystem.cli", *args], env=cli_env(redis_url), cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out


def fleet_json(redis_url: str, *args: str) -> Any:
    return json.loads(fleet(redis_url, *args, "--json").stdout)


def parse(text: str) -> Samples:
    """Exposition text -> {(sample name, labels): value}, through prometheus_client's own parser."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(port: int) -> Samples:
    res = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    res.raise_for_status()
    return parse(res.text)


def collect(redis: Redis, pool: str = "llm") -> Samples:
    from prometheus_client import generate_latest

    from dispatcher.observe.metrics import registry

    return parse(generate_latest(registry(redis, pool)).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={profile}"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)
