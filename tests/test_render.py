"""Renders of plans: parsed by node (PM2), supervisor's own config loader, systemd-analyze; run for
real under PM2 and supervisord with a probe standing in for `fleet worker`; and the CLI."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ecosystem.cli.ecosystem import register
from ecosystem.planner import Plan, plan
from ecosystem.render import FORMATS, RenderOptions, render, render_pm2, render_supervisord, render_systemd
from ecosystem.topology import read_topology
from tests.pm2 import Pm2, pm2_binary

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
SYSFS = FIXTURES / "sysfs"
PROBE = FIXTURES / "probe_worker.py"

OPTIONS = RenderOptions(
    command=("/opt/llama-fleet/.venv/bin/fleet",),
    config_path="/etc/llama-fleet/worker-config.json",
    cwd="/opt/llama-fleet",
    drain_grace=20.0,
    extra_env={"FLEET_REDIS_URL": "redis://10.0.0.5:6379/0"},
)


@pytest.fixture
def two_node_plan() -> Plan:
    return plan(read_topology(SYSFS / "2node-16core-smt"))


def expected_env(name: str, cpus: str, node: int) -> dict[str, str]:
    return {
        "FLEET_BACKEND__SLOTS": "16",
        "FLEET_BACKEND__THREADS": "16",
        "FLEET_CONFIG": "/etc/llama-fleet/worker-config.json",
        "FLEET_CPUS": cpus,
        "FLEET_NAME": name,
        "FLEET_NUMA_NODE": str(node),
        "FLEET_REDIS_URL": "redis://10.0.0.5:6379/0",
    }


def node_require(path: Path) -> object:
    pm2_binary()  # scripts/install-pm2 installs Node.js where it is missing
    proc = subprocess.run(
        ["node", "-e", f"console.log(JSON.stringify(require({json.dumps(str(path))})))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# --- PM2 -------------------------------------------------------------------------------------


def test_pm2_config_loads_in_node(tmp_path: Path, two_node_plan: Plan) -> None:
    path = tmp_path / "ecosystem.config.js"
    path.write_text(render_pm2(two_node_plan, OPTIONS))
    common = {
        "script": "/opt/llama-fleet/.venv/bin/fleet",
        "args": ["worker", "--config", "/etc/llama-fleet/worker-config.json"],
        "interpreter": "none",
        "exec_mode": "fork",
        "instances": 1,
        "cwd": "/opt/llama-fleet",
        "autorestart": True,
        "exp_backoff_restart_delay": 1000,
        "kill_timeout": 30000,  # drain_grace 20 s + 10 s margin
    }
    assert node_require(path) == {
        "apps": [
            {"name": "worker-0", **common, "env": expected_env("worker-0", "0-15", 0)},
            {"name": "worker-1", **common, "env": expected_env("worker-1", "16-31", 1)},
        ]
    }


def test_pm2_python_m_launcher_and_awkward_values(tmp_path: Path, two_node_plan: Plan) -> None:
    options = RenderOptions(
        command=("/opt/my venv/bin/python", "-m", "ecosystem.cli"),
        config_path='/etc/fleet "prod"/cfg.json',
        extra_env={"FLEET_REDIS_URL": "redis://:p%40ss'w\"rd@host:6379/0"},
    )
    path = tmp_path / "ecosystem.config.js"
    path.write_text(render_pm2(two_node_plan, options))
    app = node_require(path)["apps"][0]  # type: ignore[index]
    assert app["script"] == "/opt/my venv/bin/python"
    assert app["args"] == ["-m", "ecosystem.cli", "worker", "--config", '/etc/fleet "prod"/cfg.json']
    assert app["env"]["FLEET_REDIS_URL"] == "redis://:p%40ss'w\"rd@host:6379/0"
    assert "cwd" not in app


# --- supervisord -----------------------------------------------------------------------------


def test_supervisord_config_parses(tmp_path: Path, two_node_plan: Plan) -> None:
    text = render_supervisord(two_node_plan, OPTIONS)
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    assert parser.sections() == [
        "supervisord",
        "unix_http_server",
        "supervisorctl",
        "rpcinterface:supervisor",
        "group:llama-fleet",
        "program:worker-0",
        "program:worker-1",
    ]
    assert parser["supervisord"]["nodaemon"] == "true"
    assert parser["unix_http_server"]["file"] == "%(here)s/run/supervisor.sock"
    assert parser["group:llama-fleet"]["programs"] == "worker-0,worker-1"
    prog = parser["program:worker-1"]
    assert (
        prog["command"]
        == "/opt/llama-fleet/.venv/bin/fleet worker --config /etc/llama-fleet/worker-config.json"
    )
    assert (prog["autorestart"], prog["stopsignal"], prog["stopwaitsecs"]) == ("true", "TERM", "30")
    assert prog["stdout_logfile"] == "%(here)s/run/worker-1.log"
    env = dict(item.split("=", 1) for item in prog["environment"].split(","))
    assert {k: v.strip('"') for k, v in env.items()} == expected_env("worker-1", "16-31", 1)


def test_supervisord_loads_its_own_way(tmp_path: Path, two_node_plan: Plan) -> None:
    from supervisor.options import ServerOptions

    options = RenderOptions(
        command=("/opt/fleet 100%/bin/fleet",),  # a '%' and a space must survive supervisor's parsing
        config_path="/etc/llama-fleet/worker-config.json",
        extra_env={"FLEET_REDIS_URL": "redis://:50%off@host/0"},
    )
    conf = tmp_path / "supervisord.conf"
    conf.write_text(render_supervisord(two_node_plan, options))
    (tmp_path / "run").mkdir()  # supervisord insists that its log directory exists
    loaded = ServerOptions()
    loaded.realize(args=["-c", str(conf)])
    assert loaded.nodaemon is True
    assert loaded.pidfile == str(tmp_path / "run" / "supervisord.pid")
    assert loaded.server_configs[0]["file"] == str(tmp_path / "run" / "supervisor.sock")
    (group,) = loaded.process_group_configs
    assert group.name == "llama-fleet"
    procs = {p.name: p for p in group.process_configs}
    assert sorted(procs) == ["worker-0", "worker-1"]
    w0 = procs["worker-0"]
    assert shlex.split(w0.command) == [
        "/opt/fleet 100%/bin/fleet",
        "worker",
        "--config",
        "/etc/llama-fleet/worker-config.json",
    ]
    assert w0.environment["FLEET_REDIS_URL"] == "redis://:50%off@host/0"
    assert w0.environment["FLEET_CPUS"] == "0-15"
    assert (w0.stopsignal.name, w0.stopwaitsecs, w0.stopasgroup) == ("SIGTERM", 30, True)
    assert w0.stdout_logfile == str(tmp_path / "run" / "worker-0.log")


# --- systemd ---------------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """systemd's unit syntax: [Section], Key=Value lines (keys may repeat), # and ; comments."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not Key=Value: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def test_systemd_units(two_node_plan: Plan) -> None:
    files = render_systemd(two_node_plan, OPTIONS)
    assert sorted(files) == [
        "llama-fleet-worker@.service",
        "llama-fleet-worker@worker-0.service.d/placement.conf",
        "llama-fleet-worker@worker-1.service.d/placement.conf",
        "llama-fleet.target",
    ]
    unit = parse_unit(files["llama-fleet-worker@.service"])
    assert list(unit) == ["Unit", "Service", "Install"]
    service = unit["Service"]
    assert (
        "ExecStart",
        "/opt/llama-fleet/.venv/bin/fleet worker --config /etc/llama-fleet/worker-config.json",
    ) in service
    assert ("Environment", "FLEET_NAME=%i") in service
    assert (
        "Environment",
        "FLEET_CONFIG=/etc/llama-fleet/worker-config.json FLEET_REDIS_URL=redis://10.0.0.5:6379/0",
    ) in service
    assert dict(service)["TimeoutStopSec"] == "30"
    assert dict(service)["KillSignal"] == "SIGTERM"
    assert dict(unit["Install"]) == {"WantedBy": "llama-fleet.target"}

    dropin = parse_unit(files["llama-fleet-worker@worker-1.service.d/placement.conf"])
    assert dropin == {
        "Service": [
            ("CPUAffinity", "16-31"),
            ("NUMAPolicy", "bind"),
            ("NUMAMask", "1"),
            (
                "Environment",
                "FLEET_BACKEND__SLOTS=16 FLEET_BACKEND__THREADS=16 FLEET_CPUS=16-31 FLEET_NUMA_NODE=1",
            ),
        ]
    }
    target = parse_unit(files["llama-fleet.target"])
    assert (
        dict(target["Unit"])["Wants"]
        == "llama-fleet-worker@worker-0.service llama-fleet-worker@worker-1.service"
    )


def test_systemd_without_numa_info_binds_nothing(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(SYSFS / "1node-4core-smt", root)
    shutil.rmtree(root / "devices/system/node")
    files = render_systemd(plan(read_topology(root), smt=True), OPTIONS)
    dropin = dict(parse_unit(files["llama-fleet-worker@worker-0.service.d/placement.conf"])["Service"])
    assert dropin == {
        "CPUAffinity": "0-7",
        "Environment": "FLEET_BACKEND__SLOTS=16 FLEET_BACKEND__THREADS=4 FLEET_CPUS=0-7",
    }


def test_systemd_quoting() -> None:
    options = RenderOptions(
        command=("/opt/my venv/bin/python", "-m", "ecosystem.cli"),
        config_path="/etc/fleet/50%.json",
        extra_env={"FLEET_REDIS_URL": "redis://h/0?x=$HOME"},
    )
    files = render_systemd(plan(read_topology(SYSFS / "1node-2core")), options)
    service = dict(parse_unit(files["llama-fleet-worker@.service"])["Service"])
    # '%' doubled (specifier), '$' doubled in ExecStart only (Environment= does not expand it)
    assert (
        service["ExecStart"]
        == '"/opt/my venv/bin/python" -m ecosystem.cli worker --config /etc/fleet/50%%.json'
    )
    envs = [v for k, v in parse_unit(files["llama-fleet-worker@.service"])["Service"] if k == "Environment"]
    assert envs[1] == 'FLEET_CONFIG=/etc/fleet/50%%.json "FLEET_REDIS_URL=redis://h/0?x=$HOME"'


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    assert found, "systemd-analyze is missing: Debian package `systemd` (scripts/setup installs it)"
    return found


def test_systemd_analyze_verify_finds_nothing_to_complain_about(tmp_path: Path) -> None:
    # ExecStart must name a real executable for verify to pass: use this interpreter.
    options = RenderOptions(
        command=(sys.executable, "-m", "ecosystem.cli"), config_path=str(tmp_path / "c.json")
    )
    the_plan = plan(read_topology(SYSFS / "2node-16core-smt"), workers=3)
    for name, text in render_systemd(the_plan, options).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    units = [f"llama-fleet-worker@{w.name}.service" for w in the_plan.workers] + ["llama-fleet.target"]
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", "SYSTEMD_LOG_LEVEL": "warning"}
    proc = subprocess.run(
        [systemd_analyze(), "verify", "--man=no", *units],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    ours = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if str(tmp_path) in line or "llama-fleet" in line
    ]
    assert proc.returncode == 0 and not ours, proc.stdout + proc.stderr


def test_systemd_analyze_does_complain_about_a_bad_dropin(tmp_path: Path) -> None:
    """The verify test above can fail: a broken drop-in is reported."""
    options = RenderOptions(command=(sys.executable,))
    for name, text in render_systemd(plan(read_topology(SYSFS / "1node-2core")), options).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.replace("CPUAffinity=0-1", "CPUAffinity=zero-one"))
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", "SYSTEMD_LOG_LEVEL": "warning"}
    proc = subprocess.run(
        [systemd_analyze(), "verify", "--man=no", "llama-fleet-worker@worker-0.service"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "Failed to parse CPU affinity 'zero-one'" in proc.stderr


# --- determinism and the committed examples --------------------------------------------------


def test_renders_are_deterministic(two_node_plan: Plan) -> None:
    reordered = RenderOptions(
        command=OPTIONS.command,
        config_path=OPTIONS.config_path,
        cwd=OPTIONS.cwd,
        extra_env={"B": "2", "A": "1"},
    )
    same = RenderOptions(
        command=OPTIONS.command,
        config_path=OPTIONS.config_path,
        cwd=OPTIONS.cwd,
        extra_env={"A": "1", "B": "2"},
    )
    for fmt in FORMATS:
        first = render(two_node_plan, fmt, reordered)
        assert first == render(two_node_plan, fmt, same)
        assert first == render(plan(read_topology(SYSFS / "2node-16core-smt")), fmt, reordered)


def test_committed_examples_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "render_examples.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (REPO / "ecosystem/examples/systemd/llama-fleet-worker@worker-1.service.d/placement.conf").exists()


# --- real process managers running the rendered configs ---------------------------------------


def live_plan() -> Plan:
    """This machine, one worker per core (up to 2) so each probe gets its own CPU."""
    topology = read_topology("/sys", allowed=os.sched_getaffinity(0))
    return plan(topology, workers=min(2, len(topology.cores)))


def probe_options(out: Path) -> RenderOptions:
    return RenderOptions(
        command=(sys.executable, str(PROBE)),
        config_path=str(out / "worker-config.json"),
        cwd=str(out),
        drain_grace=5.0,
        run_dir="%(here)s/run",
        extra_env={"PYTHONPATH": str(REPO), "PROBE_OUT": str(out)},
    )


def wait_for(paths: list[Path], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, (
            f"timed out waiting for {[str(p) for p in paths if not p.exists()]}"
        )
        time.sleep(0.1)


def check_probes(out: Path, the_plan: Plan) -> None:
    for w in the_plan.workers:
        record = json.loads((out / f"{w.name}.json").read_text())
        assert record["cpus_allowed_list"] == w.cpu_list  # the probe pinned itself from FLEET_CPUS
        assert record["pin"]["cpus"] == w.cpu_list
        assert record["env"]["FLEET_NAME"] == w.name
        assert record["env"]["FLEET_BACKEND__THREADS"] == str(w.threads)
        assert record["argv"] == ["worker", "--config", str(out / "worker-config.json")]
        assert record["cwd"] == str(out)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="fleet-eco-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_supervisord_runs_the_rendered_config(short_tmp: Path) -> None:
    the_plan = live_plan()
    conf = short_tmp / "supervisord.conf"
    conf.write_text(render_supervisord(the_plan, probe_options(short_tmp)))
    (short_tmp / "run").mkdir()
    daemon = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)])
    ctl = [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf)]
    try:
        wait_for([short_tmp / f"{w.name}.json" for w in the_plan.workers])
        check_probes(short_tmp, the_plan)
        deadline = time.monotonic() + 30
        while True:  # RUNNING once startsecs (5 s) have passed
            status = subprocess.run([*ctl, "status"], capture_output=True, text=True).stdout
            if status.count("RUNNING") == len(the_plan.workers) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for w in the_plan.workers:
            assert f"llama-fleet:{w.name}" in status and "RUNNING" in status, status
        subprocess.run([*ctl, "shutdown"], capture_output=True, text=True, timeout=60)
        assert daemon.wait(timeout=60) == 0
        for w in the_plan.workers:
            assert (short_tmp / f"{w.name}.stopped").read_text() == "SIGTERM"
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            daemon.wait(timeout=30)


@pytest.mark.model
@pytest.mark.slow
def test_pm2_runs_the_rendered_config(short_tmp: Path) -> None:
    the_plan = live_plan()
    config = short_tmp / "ecosystem.config.js"
    config.write_text(render_pm2(the_plan, probe_options(short_tmp)))
    pm2 = Pm2(short_tmp / "pm2home")
    try:
        pm2.check("start", str(config))
        wait_for([short_tmp / f"{w.name}.json" for w in the_plan.workers])
        check_probes(short_tmp, the_plan)
        apps = pm2.apps()
        assert sorted(apps) == sorted(w.name for w in the_plan.workers)
        assert {a["pm2_env"]["status"] for a in apps.values()} == {"online"}
        pm2.check("stop", "all")
        wait_for([short_tmp / f"{w.name}.stopped" for w in the_plan.workers])
        # PM2 has no per-app stop signal: the worker must drain on SIGINT as on SIGTERM.
        assert {(short_tmp / f"{w.name}.stopped").read_text() for w in the_plan.workers} == {"SIGINT"}
    finally:
        pm2.kill()


# --- CLI -------------------------------------------------------------------------------------


@pytest.fixture
def fleet() -> click.Group:
    @click.group()
    def cli() -> None:
        pass

    register(cli)
    return cli


def test_cli_plan_json(fleet: click.Group) -> None:
    result = CliRunner().invoke(
        fleet,
        [
            "plan",
            "--sysfs-root",
            str(SYSFS / "2node-interleaved"),
            "--workers",
            "3",
            "--slots",
            "8",
            "--json",
        ],
        env={"FLEET_CONFIG": None},
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {
        "topology": "2 nodes, 8 cores, 16 CPUs (SMT)",
        "smt": False,
        "reserved_cpus": "",
        "workers": [
            {"name": "worker-0", "cpus": "0,2", "numa_node": 0, "threads": 2, "slots": 8},
            {"name": "worker-1", "cpus": "4,6", "numa_node": 0, "threads": 2, "slots": 8},
            {"name": "worker-2", "cpus": "1,3,5,7", "numa_node": 1, "threads": 4, "slots": 8},
        ],
        "notes": [],
    }


def test_cli_plan_table_and_errors(fleet: click.Group) -> None:
    runner = CliRunner()
    args = ["plan", "--sysfs-root", str(SYSFS / "2node-16core-smt")]
    table = runner.invoke(fleet, [*args, "--reserve-cores", "2", "--smt"], env={"FLEET_CONFIG": None})
    assert table.exit_code == 0, table.output
    assert "worker-0" in table.output and "0-13,32-45" in table.output
    assert "reserved cpus (Redis, OS): 14-15,46-47" in table.output
    too_many = runner.invoke(fleet, [*args, "--workers", "33"], env={"FLEET_CONFIG": None})
    assert too_many.exit_code == 1
    assert "33 workers requested but only 32 free physical cores (node 0: 16, node 1: 16)" in too_many.output
    bad = runner.invoke(fleet, [*args, "--workers", "many"])
    assert bad.exit_code == 2 and "'many' is neither a number nor 'auto'" in bad.output


def test_cli_slots_default_come_from_the_config(fleet: click.Group, tmp_path: Path) -> None:
    config = tmp_path / "worker-config.json"
    config.write_text(json.dumps({"backend": {"slots": 24}, "drain_grace": 40}))
    result = CliRunner().invoke(
        fleet,
        [
            "ecosystem",
            "--format",
            "pm2",
            "--sysfs-root",
            str(SYSFS / "1node-2core"),
            "--config",
            str(config),
            "--command",
            "/usr/bin/fleet",
            "--env",
            "FLEET_REDIS_URL=redis://r:1/0",
        ],
    )
    assert result.exit_code == 0, result.output
    js = tmp_path / "ecosystem.config.js"
    js.write_text(result.stdout)
    (app,) = node_require(js)["apps"]  # type: ignore[index]
    assert app["env"]["FLEET_BACKEND__SLOTS"] == "24"
    assert app["env"]["FLEET_REDIS_URL"] == "redis://r:1/0"
    assert app["env"]["FLEET_CONFIG"] == str(config)
    assert app["kill_timeout"] == 50000
    assert app["script"] == "/usr/bin/fleet"


@pytest.mark.parametrize("fmt", ["pm2", "supervisord", "systemd"])
def test_cli_reproduces_the_committed_examples(fleet: click.Group, tmp_path: Path, fmt: str) -> None:
    args = [
        "ecosystem",
        "--format",
        fmt,
        "--workers",
        "auto",
        "--sysfs-root",
        str(SYSFS / "2node-16core-smt"),
    ]
    args += [
        "--config",
        "/etc/llama-fleet/worker-config.json",
        "--command",
        "/opt/llama-fleet/.venv/bin/fleet",
    ]
    args += ["--cwd", "/opt/llama-fleet", "-o", str(tmp_path / "out")]
    if fmt == "systemd":
        args += ["--user", "llama-fleet"]
    result = CliRunner().invoke(fleet, args, env={"FLEET_CONFIG": None})
    assert result.exit_code == 0, result.output
    examples = REPO / "ecosystem" / "examples"
    if fmt == "systemd":
        out, committed = tmp_path / "out", examples / "systemd"
        written = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
        assert written == sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
        for rel in written:
            assert (out / rel).read_text() == (committed / rel).read_text()
    else:
        name = "ecosystem.config.js" if fmt == "pm2" else "supervisord.conf"
        assert (tmp_path / "out").read_text() == (examples / name).read_text()


def test_cli_ecosystem_writes_files(fleet: click.Group, tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["--sysfs-root", str(SYSFS / "2node-16core-smt"), "--config", str(tmp_path / "absent.json")]
    out = runner.invoke(fleet, ["ecosystem", "--format", "systemd", *base, "-o", str(tmp_path / "units")])
    assert out.exit_code == 0, out.output
    assert sorted(
        p.relative_to(tmp_path / "units").as_posix() for p in (tmp_path / "units").rglob("*") if p.is_file()
    ) == [
        "llama-fleet-worker@.service",
        "llama-fleet-worker@worker-0.service.d/placement.conf",
        "llama-fleet-worker@worker-1.service.d/placement.conf",
        "llama-fleet.target",
    ]
    assert "not found here" in out.output  # the config is for another host: noted, not fatal
    sv = runner.invoke(
        fleet,
        ["ecosystem", "--format", "supervisord", *base, "-o", str(tmp_path / "sv" / "supervisord.conf")],
    )
    assert sv.exit_code == 0, sv.output
    assert (tmp_path / "sv" / "run").is_dir()  # created, since supervisord will not
    bad_env = runner.invoke(fleet, ["ecosystem", "--format", "pm2", *base, "--env", "NOEQUALS"])
    assert bad_env.exit_code == 2 and "'NOEQUALS' is not KEY=VALUE" in bad_env.output
