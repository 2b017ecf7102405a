"""An interrupted producer cancels its job unless told to detach: Ctrl-C on
`fleet submit --stream`, a stream() generator closed early, a `with` block left by an exception.
The worker runs in this process (fake engine) on a thread; the CLI is a real subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from redis import Redis

from backends.contract.keys import job_key
from backends.contract.replies import as_str
from dispatcher import Fleet
from tests.harness import ROOT, default_sigint
from tests.lossy import inproc_worker, long_prompt
from worker.serving.loop import FleetWorker

pytestmark = pytest.mark.timeout(120)
WORDS = 20_000  # the fake engine emits one word per step: long enough to interrupt
STEP_S = 0.002  # paced like an engine: 8,000 words take 16 s, so an interrupt always lands mid-job


@pytest.fixture
def serving(redis_url: str) -> Iterator[FleetWorker]:
    fw = inproc_worker(redis_url, "i1", backend={"step_delay": STEP_S})
    thread = threading.Thread(target=fw.run, daemon=True)
    thread.start()
    yield fw
    fw.stop()
    thread.join(30)


def test_closing_a_stream_early_cancels_the_job(redis_url: str, serving: FleetWorker) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(WORDS), max_tokens=8000)
    deltas = job.stream(timeout=30)
    assert next(deltas)
    deltas.close()  # what leaving a `for` loop in a `with`/`finally` does to the generator
    assert job.result(timeout=30)["finish_reason"] == "cancelled"


def test_a_detached_stream_leaves_the_job_running(redis_url: str, serving: FleetWorker) -> None:
    job = Fleet(redis_url).submit(prompt=long_prompt(300), max_tokens=300)
    deltas = job.stream(timeout=30, detach=True)
    assert next(deltas)
    deltas.close()
    assert job.result(timeout=60)["finish_reason"] == "length"


def test_leaving_a_with_block_by_an_exception_cancels(redis_url: str, serving: FleetWorker) -> None:
    fleet = Fleet(redis_url)
    with pytest.raises(KeyboardInterrupt), fleet.submit(prompt=long_prompt(WORDS), max_tokens=8000) as job:
        for _text in job.stream(timeout=30, detach=True):  # the `with` decides here
            raise KeyboardInterrupt
    assert job.result(timeout=30)["finish_reason"] == "cancelled"


def test_ctrl_c_on_fleet_submit_stream_cancels_the_job(redis_url: str, redis: Redis,
                                                       serving: FleetWorker) -> None:
    env = {**os.environ, "FLEET_REDIS_URL": redis_url, "FLEET_CONFIG": str(ROOT / "worker-config.json")}
    args = ["submit", "--stream", "--max-tokens", "8000", long_prompt(WORDS)]
    cli = subprocess.Popen([sys.executable, "-m", "ecosystem.cli", *args], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)
    try:
        assert cli.stdout is not None and cli.stdout.read(20)  # tokens are arriving
        cli.send_signal(signal.SIGINT)
        _out, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130, err
    [key] = redis.keys(job_key("*"))
    job = Fleet(redis_url).job(str(as_str(key)).split(":", 2)[2])
    assert job.result(timeout=30)["finish_reason"] == "cancelled"
    assert b"cancelled job" in err
