"""One worker-config.json configures the whole fleet: the example docs/gateway.md shows (read from
the doc itself, so the two cannot drift) starts a real worker that runs a job, `fleet serve` and
`fleet ecosystem --format kubernetes`; a key no part knows, at the top level or inside `gateway`,
still stops each of them with a message that names it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from dispatcher import Fleet
from ecosystem.local.processes import free_port
from tests.gateway_harness import start_gateway, wait_until_healthy
from tests.harness import ROOT, start_worker, worker_env

pytestmark = pytest.mark.timeout(300)


def documented_config() -> dict[str, Any]:
    """The JSON block under "## Settings" in docs/gateway.md, as written there."""
    text = (ROOT / "docs" / "gateway.md").read_text()
    section = text.split("\n## Settings\n", 1)[1]
    match = re.search(r"```json\n(.*?)```", section, re.S)
    assert match, "docs/gateway.md lost its settings example"
    return dict(json.loads(match.group(1)))


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "worker-config.json"
    path.write_text(json.dumps(config))
    return path


def fleet(config: Path, redis_url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The command, run to its end; one still running after `timeout` is stopped and reported as
    started (returncode 0). The file's redis_url points at a default Redis; the environment (which
    wins) at the test's."""
    command = [sys.executable, "-m", "ecosystem.cli", *args]
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=worker_env(redis_url, "one-file", config=config))
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(command, 0, "", f"still running after {timeout}s\n{err}")


@pytest.mark.model
def test_the_documented_config_starts_a_worker_the_gateway_and_a_kubernetes_render(
        redis_url: str, tmp_path: Path) -> None:
    config = documented_config()
    assert "gateway" in config and "backend" not in config  # the engine: the default llama-cpp
    path = write(tmp_path, config)
    logs = tmp_path / "logs"
    worker = start_worker(redis_url, "one-file", logs, config=path, backend__slots=2)
    gateway = None
    try:
        job = Fleet(redis_url).submit(prompt="Once upon a time", max_tokens=4, temperature=0)
        result = job.result(timeout=120)
        assert result["worker"] == "one-file" and result["usage"]["completion_tokens"] == 4
        gateway = start_gateway(redis_url, logs, port=free_port(), config=path)
        wait_until_healthy(gateway)
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        # the model name the example adds to the pool's own names (its name and its model's)
        assert [m.id for m in client.models.list().data] == ["gemma-3-270m", "gemma3:270m", "llm"]
        done = client.completions.create(model="gemma-3-270m", prompt="Once upon a time", max_tokens=4)
        assert done.usage is not None and done.usage.completion_tokens == 4
    finally:
        for process in (worker, gateway):
            if process is not None and process.alive():
                process.stop()
    rendered = fleet(path, redis_url, "ecosystem", "--format", "kubernetes", "--workers", "1",
                     "-o", str(tmp_path / "k8s"))
    assert rendered.returncode == 0, rendered.stderr
    assert (tmp_path / "k8s" / "gateway-deployment.yaml").exists()


@pytest.mark.model
@pytest.mark.parametrize("where", ["top level", "gateway"])
def test_an_unknown_key_stops_the_worker_the_gateway_and_the_render(redis_url: str, tmp_path: Path,
                                                                    where: str) -> None:
    config = documented_config()
    if where == "top level":
        config["redis_ur1"] = "redis://typo:6379/0"
        named = "redis_ur1"
    else:
        config["gateway"]["api_key"] = ["singular"]
        named = "gateway.api_key"
    path = write(tmp_path, config)
    runs = {
        "worker": fleet(path, redis_url, "worker"),
        "serve": fleet(path, redis_url, "serve", "--port", str(free_port()), timeout=30),
        "kubernetes": fleet(path, redis_url, "ecosystem", "--format", "kubernetes", "--workers", "1"),
    }
    problems = []
    for command, run in runs.items():
        said = run.stderr.strip()[-1500:]
        if run.returncode == 0:
            problems.append(f"{command} started: {said}")
        elif named not in run.stderr or "Traceback" in run.stderr:
            problems.append(f"{command} did not name {named}: {said}")
        elif where == "top level" and "gateway:" in run.stderr:  # the documented section is fine
            problems.append(f"{command} blamed the gateway section: {said}")
    assert not problems, "\n".join(problems)


def test_the_producers_know_every_key_the_worker_reads() -> None:
    """The contract lists the keys of the parts above it by name: the list must be the worker's."""
    from backends.contract.settings import OTHER_PARTS_KEYS, ProducerSettings
    from worker.settings import FleetSettings

    assert set(FleetSettings.model_fields) - set(ProducerSettings.model_fields) == OTHER_PARTS_KEYS
