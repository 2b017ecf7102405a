"""Security with real processes: a worker never runs what a producer smuggles in (pickle, another
function, callbacks, webhooks), and Redis credentials (password, ACL user, TLS) work end to end
without ever showing up in worker logs or `fleet status`."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Callback, Queue
from rq.serializers import JSONSerializer
from rq.webhook import Webhook

from backends.contract.keys import JOB_FUNCTION, job_key, queue_key
from backends.contract.redact import redact_url
from dispatcher import Fleet, JobFailed
from ecosystem.local.processes import free_port
from tests.harness import ROOT, worker_env
from tests.reliability_checks import fleet_workers, start_guarded_redis

pytestmark = pytest.mark.timeout(180)
QUEUE = "llm:default"


class Trap:
    """Unpickling this runs a shell command: the worker must never unpickle anything."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_worker_refuses_code_it_was_not_asked_to_run(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    markers = {k: tmp_path / f"{k}-ran" for k in ("function", "pickle")}
    queue = Queue(QUEUE, connection=redis, serializer=JSONSerializer)
    hook = Webhook("http://127.0.0.1:9/hook", job_status="finished")
    jobs = {
        "foreign": queue.enqueue("os.system", f"touch {markers['function']}"),
        "callback": queue.enqueue(JOB_FUNCTION, {"prompt": "hi"}, on_success=Callback("os.getcwd")),
        "webhook": queue.enqueue(JOB_FUNCTION, {"prompt": "hi"}, webhooks=[hook]),
        "pickle": queue.enqueue(JOB_FUNCTION, {"prompt": "hi"}),  # its payload swapped for a pickle:
    }
    trap = pickle.dumps((JOB_FUNCTION, None, (Trap(markers["pickle"]),), {}))
    redis.hset(job_key(jobs["pickle"].id), "data", zlib.compress(trap))
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        workers.start("s1", backend__type="fake")
        fleet = Fleet(redis_url)
        reasons = {}
        for name, job in jobs.items():
            with pytest.raises(JobFailed) as failed:
                fleet.job(job.id).result(timeout=20)
            reasons[name] = failed.value.error
        after = fleet.submit(prompt="still serving", max_tokens=4).result(timeout=20)
    assert after["text"] == "still serving"
    assert "refused: job names function 'os.system'" in reasons["foreign"]
    assert reasons["callback"] == "refused: fleet jobs may not carry callbacks"
    assert reasons["webhook"] == "refused: fleet jobs may not carry webhooks"
    assert reasons["pickle"].startswith("refused: payload is not a JSON job")
    assert not [m for m in markers.values() if m.exists()], "a refused job ran code"
    assert redis.zcard(f"rq:failed:{QUEUE}") == 4 and not redis.llen(queue_key(QUEUE))


def fleet_cli(*args: str, redis_url: str) -> subprocess.CompletedProcess[str]:
    env = worker_env(redis_url, "cli")
    return subprocess.run([sys.executable, "-m", "ecosystem.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


SECRETS = ("admin-secret", "fleet-secret")
ACL = ["--requirepass", "admin-secret",
       "--user", "fleet", "on", ">fleet-secret", "~*", "&*", "+@all", "-@dangerous"]


@pytest.mark.model
def test_password_and_acl_user_urls_work_and_stay_secret(tmp_path: Path) -> None:
    admin = "redis://:admin-secret@127.0.0.1:{}/0".format
    with start_guarded_redis(tmp_path / "redis", ACL, admin) as server:
        user_url = f"redis://fleet:fleet-secret@127.0.0.1:{server.port}/0"
        with fleet_workers(user_url, tmp_path / "logs") as workers:
            worker = workers.start("acl-1", backend__type="fake")
            # the producer too: every entry point under the ACL is tests/test_acl_entry_points.py
            result = Fleet(user_url).submit(prompt="through the ACL", max_tokens=4).result(timeout=20)
            assert result["worker"] == "acl-1"
            status = fleet_cli("status", redis_url=user_url)
            status_json = fleet_cli("status", "--json", redis_url=user_url)
        wrong = fleet_cli("worker", redis_url=f"redis://fleet:not-the-password@127.0.0.1:{server.port}/0")
    assert status.returncode == 0 and status_json.returncode == 0, status.stderr + status_json.stderr
    assert "fleet:***@" in status.stdout
    assert [w["name"] for w in json.loads(status_json.stdout)["workers"]] == ["acl-1"]
    assert wrong.returncode != 0 and "fleet:***@" in wrong.stderr and "Traceback" not in wrong.stderr
    shown = worker.output() + status.stdout + status.stderr + status_json.stdout + wrong.stdout + wrong.stderr
    assert not [s for s in (*SECRETS, "not-the-password") if s in shown], "a credential was printed"


def make_tls_files(dir: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1, with the openssl command line tool."""
    dir.mkdir(parents=True, exist_ok=True)
    files = {name: dir / f"{name}.pem" for name in ("ca", "ca-key", "server", "server-key")}
    ext = dir / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fleet-test-ca",
            "-keyout", str(files["ca-key"]), "-out", str(files["ca"]))
    csr = dir / "server.csr"
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", str(files["server-key"]), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey", str(files["ca-key"]),
            "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(files["server"]))
    return files


def test_rediss_tls_url_works(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    tls_port = free_port()
    extra = ["--port", "0", "--tls-port", str(tls_port), "--tls-cert-file", str(tls["server"]),
             "--tls-key-file", str(tls["server-key"]), "--tls-ca-cert-file", str(tls["ca"]),
             "--tls-auth-clients", "no", "--requirepass", "tls-secret"]
    url = f"rediss://:tls-secret@127.0.0.1:{tls_port}/0?ssl_ca_certs={tls['ca']}"
    with start_guarded_redis(tmp_path / "redis", extra, lambda _port: url), \
            fleet_workers(url, tmp_path / "logs") as workers:
        worker = workers.start("tls-1", backend__type="fake")
        result = Fleet(url).submit(prompt="over TLS", max_tokens=4).result(timeout=20)
        plain = Redis(port=tls_port, socket_connect_timeout=1, retry=None)
        with pytest.raises(RedisConnectionError):  # the server speaks only TLS
            plain.ping()
    assert result["text"] == "over TLS" and result["worker"] == "tls-1"
    assert "tls-secret" not in worker.output()


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://:secret@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
    ("rediss://u:p%40ss@h/1", "rediss://u:***@h/1"),
    ("redis://host/0?password=secret&socket_timeout=5", "redis://host/0?password=***&socket_timeout=5"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
    ("unix:///run/redis.sock?password=secret", "unix:///run/redis.sock?password=***"),
])
def test_printed_redis_urls_hide_every_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
