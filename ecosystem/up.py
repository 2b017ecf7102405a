"""`fleet up` / `fleet down`: the planned fleet under supervisord on this machine.

    fleet up [plan options]      foreground; Ctrl-C or SIGTERM: the workers drain (supervisord
                                 sends TERM, waits stopwaitsecs), then the private Redis and
                                 supervisord stop, and `fleet up` returns
    fleet up --daemon            returns once every worker has registered; `fleet down` stops it

The run directory ($FLEET_RUN_DIR, else $XDG_STATE_HOME/llama-fleet/up) holds supervisord.conf,
fleet-up.json (supervisord's pid and what it runs), the logs of supervisord, each worker and Redis,
and, when fleet up runs its own Redis, redis.conf and redis/ (the append-only file).

supervisord runs in its own session, so a terminal's Ctrl-C reaches only `fleet up`, which forwards
one SIGTERM; in the foreground it also gets PDEATHSIG=SIGTERM, so a killed `fleet up` still leaves
a fleet that drains and stops rather than an orphan.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xmlrpc.client
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from redis.exceptions import RedisError

from backends.contract.connect import redis_from_url
from backends.contract.redact import redact_url
from dispatcher import status as fleet_status
from ecosystem.planner import Plan
from ecosystem.private_redis import PrivateRedis, private_redis_for, redis_server_binary
from ecosystem.render import RenderOptions, Service, render_supervisord

SOCKET_MAX = 100  # a unix socket path must fit sun_path (108 bytes)
POLL = 0.25
FAILED_STARTS = 3  # a worker that exits this many times before it is up fails `fleet up`
REDIS_PROGRAM = "redis"
AUTOSCALE_PROGRAM = "autoscale"
PR_SET_PDEATHSIG = 1


class UpError(Exception):
    """The fleet could not be brought up or down; the message says why and where the logs are."""


class Interrupted(Exception):
    """A stop signal arrived while the fleet was starting."""


def _sv(path: Path) -> str:
    return str(path).replace("%", "%%")


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def default(cls) -> RunDir:
        if env := os.environ.get("FLEET_RUN_DIR"):
            return cls(Path(env).absolute())
        state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        return cls(state.absolute() / "llama-fleet" / "up")

    @property
    def conf(self) -> Path:
        return self.root / "supervisord.conf"

    @property
    def state_file(self) -> Path:
        return self.root / "fleet-up.json"

    @property
    def log(self) -> Path:
        return self.root / "supervisord.log"

    @property
    def out(self) -> Path:
        return self.root / "supervisord.out"

    @property
    def redis_conf(self) -> Path:
        return self.root / "redis.conf"

    @property
    def redis_data(self) -> Path:
        return self.root / "redis"

    @property
    def socket(self) -> Path:
        path = self.root / "supervisor.sock"
        if len(str(path)) <= SOCKET_MAX:
            return path
        digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"llama-fleet-{digest}.sock"

    def program_log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def running(self) -> dict[str, Any] | None:
        """The state of the live supervisord started from here, else None (stale files ignored)."""
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
            proc = psutil.Process(int(state["pid"]))
            same = abs(proc.create_time() - float(state["create_time"])) < 0.01
            return state if same and _alive(proc) else None
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pid_alive(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} not written)"
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Launch:
    """One supervisord running the plan (and maybe a private Redis) from a run directory."""

    run: RunDir
    plan: Plan
    redis_url: str
    private: PrivateRedis | None
    stop_timeout: int
    process: subprocess.Popen[bytes] | None = None
    procs: dict[str, psutil.Process] = field(default_factory=dict)  # program -> its process
    stop_requested: bool = False
    scale_from_zero: bool = False  # the workers start stopped; `fleet autoscale` starts them

    @classmethod
    def prepare(cls, run: RunDir, plan: Plan, options: RenderOptions, redis_url: str,
                appendfsync: str = "everysec", autoscale: tuple[str, ...] = ()) -> Launch:
        """Check nothing runs here yet, decide about Redis, write the configs. `autoscale`: the
        arguments of `fleet autoscale` (the workers then start stopped: scale from zero)."""
        if state := run.running():
            raise UpError(
                f"a fleet is already up from {run.root} (supervisord pid {state['pid']}): "
                "`fleet down` first, or pass another --run-dir"
            )
        try:
            import supervisor.supervisord  # noqa: F401
        except ImportError:
            raise UpError("supervisor is not installed: pip install 'llama-fleet[supervisor]'") from None
        private = private_redis_for(redis_url, appendfsync)
        run.root.mkdir(parents=True, exist_ok=True)
        services: tuple[Service, ...] = ()
        if private is not None:
            run.redis_data.mkdir(exist_ok=True)
            _write_private(run.redis_conf, private.config(run.redis_data))
            services = (Service(REDIS_PROGRAM, (redis_server_binary(), str(run.redis_conf))),)
        options = replace(options, run_dir=_sv(run.root), supervisor_socket=_sv(run.socket),
                          autostart=not autoscale)
        if autoscale:
            command = (*options.command, "autoscale", "--supervisor-socket", str(run.socket), *autoscale)
            services = (*services, Service(AUTOSCALE_PROGRAM, command, priority=2))
        run.conf.write_text(render_supervisord(plan, options, services))
        return cls(run, plan, redis_url, private, options.stop_timeout, scale_from_zero=bool(autoscale))

    @property
    def programs(self) -> list[str]:
        names = [w.name for w in self.plan.workers]
        return [*names, REDIS_PROGRAM] if self.private else names

    def start(self, daemon: bool) -> None:
        argv = [sys.executable, "-m", "supervisor.supervisord", "-c", str(self.run.conf)]
        with self.run.out.open("ab") as out:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if daemon else _die_with_parent,  # no threads yet: safe
            )
        state = {
            "pid": self.process.pid,
            "create_time": psutil.Process(self.process.pid).create_time(),
            "daemon": daemon,
            "workers": [w.name for w in self.plan.workers],
            "redis": redact_url(self.redis_url),
            "private_redis": self.private is not None,
            "stop_timeout": self.stop_timeout,
        }
        self.run.state_file.write_text(json.dumps(state, indent=2) + "\n")

    # -- signals ----------------------------------------------------------------------------------

    def forward_signals(self, note: Callable[[str], None]) -> None:
        """SIGINT/SIGTERM/SIGHUP to `fleet up` become one SIGTERM to supervisord."""

        def handler(signum: int, _frame: object) -> None:
            if self.stop_requested:
                note(f"still stopping: workers drain for up to {self.stop_timeout}s")
                return
            name = signal.Signals(signum).name
            note(f"{name}: draining workers (up to {self.stop_timeout}s), then stopping")
            self.request_stop()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, handler)

    def request_stop(self) -> None:
        self.stop_requested = True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    # -- waiting ----------------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> list[dict[str, Any]]:
        """Block until every planned worker has registered from the process supervisord started
        for it; return their status rows. Fails early on a worker that keeps exiting."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        starts: dict[str, set[float]] = {}
        while True:
            if self.stop_requested:
                raise Interrupted
            rc = self.process.poll()
            if rc is not None:
                raise UpError(
                    f"supervisord exited ({rc}) before the fleet was up:\n"
                    f"{tail(self.run.out)}\n{tail(self.run.log)}"
                )
            infos = self.process_info()
            for info in infos:
                if info["statename"] in ("BACKOFF", "EXITED", "FATAL"):
                    starts.setdefault(info["name"], set()).add(info["start"])
                    if info["statename"] == "FATAL" or len(starts[info["name"]]) >= FAILED_STARTS:
                        raise UpError(
                            f"{info['name']} keeps exiting ({info['statename']}, "
                            f"{info.get('spawnerr') or 'see its log'}); its log "
                            f"{self.run.program_log(info['name'])} ends:\n"
                            f"{tail(self.run.program_log(info['name']))}"
                        )
            if self.scale_from_zero:  # up once the autoscaler runs: the workers start on demand
                if any(i["name"] == AUTOSCALE_PROGRAM and i["statename"] == "RUNNING" for i in infos):
                    return []
            elif (rows := self._registered()) is not None:
                return rows
            if time.monotonic() > deadline:
                states = ", ".join(f"{i['name']} {i['statename']}" for i in infos) or "none reported"
                raise UpError(
                    f"the fleet was not up after {timeout:.0f}s (programs: {states}); logs in {self.run.root}"
                )
            time.sleep(POLL)

    def process_info(self) -> list[dict[str, Any]]:
        """supervisord's view of its programs (empty while its socket is not up yet)."""
        try:
            infos: list[dict[str, Any]] = supervisor_proxy(self.run.socket).supervisor.getAllProcessInfo()
        except (OSError, xmlrpc.client.Error):
            return []
        for info in infos:
            pid, known = int(info.get("pid") or 0), self.procs.get(info["name"])
            if pid and (known is None or known.pid != pid):
                with contextlib.suppress(psutil.Error):
                    self.procs[info["name"]] = psutil.Process(pid)
        return infos

    def _registered(self) -> list[dict[str, Any]] | None:
        """Worker status rows once each planned worker is registered with supervisord's pid for it."""
        try:
            with redis_from_url(self.redis_url, socket_connect_timeout=1, socket_timeout=2) as redis:
                live = {str(w["name"]): w for w in fleet_status.workers(redis)}
        except (RedisError, OSError):
            return None
        rows = []
        for w in self.plan.workers:
            row = live.get(w.name)
            proc = self.procs.get(w.name)
            if row is None or proc is None or int(row.get("pid", -1)) != proc.pid:
                return None
            rows.append(row)
        return rows

    def wait(self) -> int:
        """Wait for supervisord to exit (it stops everything first); its exit code."""
        assert self.process is not None
        return self.process.wait()

    def stop_leftovers(self) -> list[str]:
        """After supervisord has exited: stop what it left running (it only does that when it was
        killed): workers first, with SIGTERM so they drain while Redis is still up, then Redis.
        Returns the programs that had to be stopped."""
        left = {name: proc for name, proc in self.procs.items() if _alive(proc)}
        workers = [proc for name, proc in left.items() if name != REDIS_PROGRAM]
        redis = [proc for name, proc in left.items() if name == REDIS_PROGRAM]
        for group in (workers, redis):
            for proc in group:
                with contextlib.suppress(psutil.Error):
                    proc.terminate()
            deadline = time.monotonic() + self.stop_timeout
            while any(_alive(p) for p in group) and time.monotonic() < deadline:
                time.sleep(POLL)
            for proc in group:
                if _alive(proc):
                    proc.kill()
        return [f"{name} (pid {proc.pid})" for name, proc in sorted(left.items())]


def supervisor_proxy(socket: Path) -> Any:
    """supervisord's XML-RPC interface on its unix socket."""
    from supervisor.xmlrpc import SupervisorTransport

    transport = SupervisorTransport(None, None, f"unix://{socket}")
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def down(run: RunDir, timeout: float | None = None) -> dict[str, Any] | None:
    """SIGTERM the supervisord started from `run` and wait until it (and with it every worker and
    the private Redis) is gone. None when nothing runs there."""
    state = run.running()
    if state is None:
        return None
    pid = int(state["pid"])
    wait = timeout if timeout is not None else float(state.get("stop_timeout", 30)) * 2 + 30
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise UpError(f"supervisord (pid {pid}) still running after {wait:.0f}s; see {run.log}")
        time.sleep(POLL)
    return state
