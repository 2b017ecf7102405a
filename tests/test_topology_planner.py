"""Topology read from recorded sysfs trees (tests/fixtures/sysfs, see make_sysfs.py) and the plans
made from them. Plans are asserted whole: names, CPUs, node, threads, slots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import cast

import psutil
import pytest

from ecosystem.planner import Plan, PlanError, plan
from ecosystem.topology import Topology, read_topology
from worker.settings import format_cpu_list, parse_cpu_list

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"


def topo(name: str) -> Topology:
    return read_topology(FIXTURES / name)


def rows(p: Plan) -> list[tuple[str, str, int | None, int, int]]:
    return [(w.name, w.cpu_list, w.numa_node, w.threads, w.slots) for w in p.workers]


# --- topology --------------------------------------------------------------------------------


def test_two_core_box_topology() -> None:
    t = topo("1node-2core")
    assert t.numa and not t.smt
    assert [n.id for n in t.nodes] == [0]
    assert [c.cpus for c in t.cores] == [(0,), (1,)]
    assert t.summary() == "1 node, 2 cores, 2 CPUs"
    assert t.notes == ()


def test_smt_siblings_are_grouped_into_cores() -> None:
    t = topo("1node-4core-smt")
    assert t.smt
    assert [c.cpus for c in t.cores] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert t.cpus == tuple(range(8))


def test_two_nodes_cores_identified_by_siblings_not_core_id() -> None:
    # core_id repeats 0..15 in each package; only the sibling sets tell the 32 cores apart.
    t = topo("2node-16core-smt")
    assert t.summary() == "2 nodes, 32 cores, 64 CPUs (SMT)"
    assert [c.cpus for c in t.node(0).cores] == [(i, i + 32) for i in range(16)]
    assert [c.cpus for c in t.node(1).cores] == [(i, i + 32) for i in range(16, 32)]
    assert {c.package for c in t.node(1).cores} == {1}


def test_interleaved_numbering() -> None:
    t = topo("2node-interleaved")
    assert t.node(0).cpus == tuple(range(0, 16, 2))
    assert t.node(1).cpus == tuple(range(1, 16, 2))
    assert [c.cpus for c in t.node(0).cores] == [(0, 8), (2, 10), (4, 12), (6, 14)]


def test_offline_cpu_leaves_its_core_with_one_thread(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "1node-4core-smt", root)
    (root / "devices/system/cpu/online").write_text("0-6\n")
    t = read_topology(root)
    assert [c.cpus for c in t.cores] == [(0, 4), (1, 5), (2, 6), (3,)]


def test_allowed_set_restricts_cpus_and_is_noted() -> None:
    t = read_topology(FIXTURES / "2node-16core-smt", allowed=[*range(16, 32), *range(48, 64)])
    assert [n.id for n in t.nodes] == [1]  # node 0 had only CPUs outside the affinity
    assert t.cpus == tuple(range(16, 32)) + tuple(range(48, 64))
    assert any("0-15,32-47 are outside" in note for note in t.notes)


def test_core_reachable_only_through_its_sibling_is_used_through_it() -> None:
    # A cpuset holding 16-63: node 0's cores are usable only via their second threads 32-47.
    t = read_topology(FIXTURES / "2node-16core-smt", allowed=range(16, 64))
    assert [c.cpus for c in t.node(0).cores] == [(i,) for i in range(32, 48)]
    assert rows(plan(t)) == [("worker-0", "32-47", 0, 16, 16), ("worker-1", "16-31", 1, 16, 16)]


def test_missing_node_dir_falls_back_to_one_node(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "1node-4core-smt", root)
    shutil.rmtree(root / "devices/system/node")
    t = read_topology(root)
    assert not t.numa
    assert [n.id for n in t.nodes] == [0]
    assert len(t.cores) == 4  # SMT grouping still comes from cpu/*/topology
    assert any("no NUMA information" in note for note in t.notes)
    assert [w.numa_node for w in plan(t).workers] == [None]  # nothing to bind memory to


def test_missing_sysfs_falls_back_to_psutil(tmp_path: Path) -> None:
    t = read_topology(tmp_path / "nothing-here")
    assert t.source == "psutil" and not t.numa
    assert len(t.cpus) == psutil.cpu_count(logical=True)
    assert "psutil reports" in t.notes[0]


def test_live_machine_matches_affinity() -> None:
    allowed = os.sched_getaffinity(0)
    t = read_topology("/sys", allowed=allowed)
    assert set(t.cpus) == allowed
    # psutil counts the whole machine's cores; a pinned runner (scripts/test) sees some of them,
    # each cut to its allowed threads
    whole = read_topology("/sys")
    assert len(whole.cores) == psutil.cpu_count(logical=False) or whole.source == "psutil"
    assert [c.cpus for c in t.cores] == [
        tuple(cpu for cpu in c.cpus if cpu in allowed) for c in whole.cores if allowed & set(c.cpus)
    ]


# --- plans -----------------------------------------------------------------------------------


def test_two_core_box_plans() -> None:
    t = topo("1node-2core")
    assert rows(plan(t)) == [("worker-0", "0-1", 0, 2, 16)]
    assert rows(plan(t, workers=2, slots=4)) == [("worker-0", "0", 0, 1, 4), ("worker-1", "1", 0, 1, 4)]
    reserved = plan(t, reserve_cores=1)
    assert rows(reserved) == [("worker-0", "0", 0, 1, 16)]
    assert reserved.reserved_cpus == (1,)


def test_smt_box_uses_physical_cores_unless_asked() -> None:
    t = topo("1node-4core-smt")
    assert rows(plan(t)) == [("worker-0", "0-3", 0, 4, 16)]
    assert rows(plan(t, smt=True)) == [("worker-0", "0-7", 0, 4, 16)]  # threads stay = cores
    assert rows(plan(t, workers=3)) == [
        ("worker-0", "0-1", 0, 2, 16),
        ("worker-1", "2", 0, 1, 16),
        ("worker-2", "3", 0, 1, 16),
    ]
    assert rows(plan(t, workers=2, smt=True)) == [
        ("worker-0", "0-1,4-5", 0, 2, 16),
        ("worker-1", "2-3,6-7", 0, 2, 16),
    ]
    p = plan(t, reserve_cores=1)
    assert rows(p) == [("worker-0", "0-2", 0, 3, 16)]
    assert p.reserved_cpus == (3, 7)  # the whole core, both threads


def test_two_node_auto_is_one_worker_per_node() -> None:
    t = topo("2node-16core-smt")
    assert rows(plan(t)) == [("worker-0", "0-15", 0, 16, 16), ("worker-1", "16-31", 1, 16, 16)]
    assert rows(plan(t, smt=True, slots=32)) == [
        ("worker-0", "0-15,32-47", 0, 16, 32),
        ("worker-1", "16-31,48-63", 1, 16, 32),
    ]
    p = plan(t, reserve_cores=2)
    assert rows(p) == [("worker-0", "0-13", 0, 14, 16), ("worker-1", "16-31", 1, 16, 16)]
    assert p.reserved_cpus == (14, 15, 46, 47)


def test_two_node_counts_spread_by_free_cores() -> None:
    t = topo("2node-16core-smt")
    assert rows(plan(t, workers=3)) == [
        ("worker-0", "0-7", 0, 8, 16),
        ("worker-1", "8-15", 0, 8, 16),
        ("worker-2", "16-31", 1, 16, 16),
    ]
    # node 0 lost 4 cores to the reservation, so the single-worker node is node 0 this time
    assert rows(plan(t, workers=3, reserve_cores=4)) == [
        ("worker-0", "0-11", 0, 12, 16),
        ("worker-1", "16-23", 1, 8, 16),
        ("worker-2", "24-31", 1, 8, 16),
    ]
    assert rows(plan(t, workers=1)) == [("worker-0", "0-15", 0, 16, 16)]


def test_two_node_cores_per_worker() -> None:
    t = topo("2node-16core-smt")
    p = plan(t, workers=4, cores_per_worker=4)
    assert rows(p) == [
        ("worker-0", "0-3", 0, 4, 16),
        ("worker-1", "4-7", 0, 4, 16),
        ("worker-2", "16-19", 1, 4, 16),
        ("worker-3", "20-23", 1, 4, 16),
    ]
    assert p.notes == ("16 free physical core(s) left unused by this plan",)
    auto = plan(t, cores_per_worker=8)
    assert [w.cpu_list for w in auto.workers] == ["0-7", "8-15", "16-23", "24-31"]
    assert [w.numa_node for w in auto.workers] == [0, 0, 1, 1]
    # 16 - 1 reserved leaves 15 on node 0: one 8-core worker fits there, the other 7 idle
    assert [w.cpu_list for w in plan(t, cores_per_worker=8, reserve_cores=1).workers] == [
        "0-7",
        "16-23",
        "24-31",
    ]


def test_interleaved_plans_follow_nodes_not_numbers() -> None:
    t = topo("2node-interleaved")
    assert rows(plan(t)) == [("worker-0", "0,2,4,6", 0, 4, 16), ("worker-1", "1,3,5,7", 1, 4, 16)]
    assert rows(plan(t, smt=True)) == [
        ("worker-0", "0,2,4,6,8,10,12,14", 0, 4, 16),
        ("worker-1", "1,3,5,7,9,11,13,15", 1, 4, 16),
    ]
    assert rows(plan(t, cores_per_worker=2)) == [
        ("worker-0", "0,2", 0, 2, 16),
        ("worker-1", "4,6", 0, 2, 16),
        ("worker-2", "1,3", 1, 2, 16),
        ("worker-3", "5,7", 1, 2, 16),
    ]
    p = plan(t, reserve_cores=1)
    assert p.reserved_cpus == (6, 14)
    assert rows(p)[0] == ("worker-0", "0,2,4", 0, 3, 16)


def test_fully_reserved_node_gets_no_worker_under_auto() -> None:
    t = topo("2node-interleaved")
    assert rows(plan(t, reserve_cores=4)) == [("worker-0", "1,3,5,7", 1, 4, 16)]


def test_worker_env_places_a_fleet_worker() -> None:
    w = plan(topo("2node-16core-smt"), smt=True).workers[1]
    assert w.env() == {
        "FLEET_NAME": "worker-1",
        "FLEET_CPUS": "16-31,48-63",
        "FLEET_BACKEND__THREADS": "16",
        "FLEET_BACKEND__SLOTS": "16",
        "FLEET_NUMA_NODE": "1",
    }


def test_plan_workers_never_share_or_straddle() -> None:
    for name in ("1node-2core", "1node-4core-smt", "2node-16core-smt", "2node-interleaved"):
        t = topo(name)
        node_of = {c: n.id for n in t.nodes for c in n.cpus}
        for kwargs in ({}, {"smt": True}, {"workers": 2}, {"cores_per_worker": 1}, {"reserve_cores": 1}):
            p = plan(t, **kwargs)
            seen: set[int] = set()
            for w in p.workers:
                assert {node_of[c] for c in w.cpus} == {w.numa_node}, (name, kwargs, w)
                assert not seen & set(w.cpus), (name, kwargs, w)
                seen |= set(w.cpus)
            assert not seen & set(p.reserved_cpus)


# --- invalid requests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "kwargs", "message"),
    [
        (
            "1node-2core",
            {"workers": 3},
            "3 workers requested but only 2 free physical cores (node 0: 2); "
            "a worker needs at least one whole core",
        ),
        (
            "1node-4core-smt",
            {"workers": 8},  # 8 logical CPUs, but only 4 cores: workers do not share cores
            "8 workers requested but only 4 free physical cores (node 0: 4)",
        ),
        (
            "2node-16core-smt",
            {"workers": 1, "cores_per_worker": 20},
            "cores_per_worker=20 would straddle NUMA nodes: the largest node (node 0) "
            "has 16 free physical cores (node 0: 16, node 1: 16)",
        ),
        (
            "2node-16core-smt",
            {"workers": 5, "cores_per_worker": 8},
            "5 workers x 8 cores do not fit: only 4 worker(s) of 8 cores fit without straddling "
            "NUMA nodes (free physical cores per node: node 0: 16, node 1: 16)",
        ),
        (
            "2node-16core-smt",
            {"workers": 2, "cores_per_worker": 16, "reserve_cores": 1},
            "2 workers x 16 cores do not fit: only 1 worker(s) of 16 cores fit",
        ),
        (
            "1node-2core",
            {"reserve_cores": 2},
            "zero cores left: the machine has 2 physical cores and 2 are reserved",
        ),
        (
            "2node-interleaved",
            {"reserve_cores": 5},
            "reserve_cores=5 but node 0 has only 4 physical cores",
        ),
        ("1node-2core", {"workers": 0}, "workers must be a positive integer or 'auto', got 0"),
        ("1node-2core", {"cores_per_worker": 0}, "cores_per_worker must be at least 1, got 0"),
        ("1node-2core", {"slots": 0}, "slots must be at least 1, got 0"),
    ],
)
def test_invalid_requests_name_the_numbers(layout: str, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError) as err:
        plan(topo(layout), **kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


# --- pinning, on this real machine (in a subprocess: pinning is per process and sticky) ---------

REPO = Path(__file__).resolve().parent.parent
NODE_ONLINE = Path("/sys/devices/system/node/online")
LIVE_NODES = parse_cpu_list(NODE_ONLINE.read_text()) if NODE_ONLINE.exists() else []


def mems_allowed() -> list[int]:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Mems_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    raise AssertionError("no Mems_allowed_list in /proc/self/status")


def sysfs_with_node_beyond_this_box(root: Path) -> int:
    """A sysfs tree whose nodes 0..N are all online, N being a node this process may not use
    (outside its cpuset mems, whatever this machine has); node N's CPUs are 1000+."""
    absent = max(mems_allowed()) + 1
    node_root = root / "devices" / "system" / "node"
    node_root.mkdir(parents=True)
    (node_root / "online").write_text(f"0-{absent}\n")
    for n in range(absent + 1):
        (node_root / f"node{n}").mkdir()
        (node_root / f"node{n}" / "cpulist").write_text(f"{1000 + n}\n")
    return absent


def run_isolated(code: str) -> dict[str, object]:
    """Run `code` in a fresh interpreter; it must print one JSON object as its last line."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def status_field(text: str, key: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(key + ":"))


def test_pin_sets_affinity_of_process_and_existing_threads() -> None:
    mine = os.sched_getaffinity(0)
    target = max(os.sched_getaffinity(0))
    out = run_isolated(
        f"""
        import json, threading, time
        from worker.machine.pinning import pin
        stop = threading.Event()
        early = threading.Thread(target=stop.wait)  # started before pin(): must be re-pinned too
        early.start()
        while early.native_id is None:
            time.sleep(0.01)
        report = pin([{target}], None)
        late_mask = []
        late = threading.Thread(target=lambda: late_mask.append(open("/proc/thread-self/status").read()))
        late.start(); late.join()
        out = {{
            "report": report.to_dict(),
            "memory": report.memory,
            "status": open("/proc/self/status").read(),
            "early": open(f"/proc/self/task/{{early.native_id}}/status").read(),
            "late": late_mask[0],
        }}
        stop.set(); early.join()
        print(json.dumps(out))
        """
    )
    for key in ("status", "early", "late"):
        assert status_field(str(out[key]), "Cpus_allowed_list") == str(target), key
    assert out["report"] == {
        "cpus": str(target),
        "numa_node": "",
        "numa_memory": "not requested",
        "numa_detail": "",
    }
    assert os.sched_getaffinity(0) == mine  # the test process itself was left alone


def test_pin_memory_on_this_machine() -> None:
    out = run_isolated(
        f"""
        import json
        from worker.machine.pinning import pin
        r = pin(None, {LIVE_NODES[0] if LIVE_NODES else 0})
        print(json.dumps({{"memory": r.memory, "summary": r.summary()}}))
        """
    )
    expected = {0: "not available", 1: "single node"}.get(len(LIVE_NODES), "bound")
    assert out["memory"] == expected, out


def test_pin_binds_memory_for_real_when_sysfs_says_two_nodes() -> None:
    # The recorded 2-node tree makes pin() take the binding path; the syscall is real, and
    # get_mempolicy reads back MPOL_BIND on node 0 (the node this box has).
    out = run_isolated(
        f"""
        import json
        from worker.machine.pinning import memory_policy, pin
        before = memory_policy()
        r = pin([0], 0, sysfs_root="{FIXTURES / "2node-16core-smt"}")
        print(json.dumps({{"before": before, "memory": r.memory, "detail": r.detail,
                           "after": memory_policy(), "summary": r.summary()}}))
        """
    )
    assert out["before"] == [0, []]  # MPOL_DEFAULT
    assert out["memory"] == "bound", out["detail"]
    assert out["after"] == [2, [0]]  # MPOL_BIND, node 0
    assert out["summary"] == "cpus 0, memory bound to node 0"


def test_pin_reports_unavailable_numa_without_raising(tmp_path: Path) -> None:
    absent = sysfs_with_node_beyond_this_box(tmp_path)
    out = run_isolated(
        f"""
        import json
        from worker.machine.pinning import bind_memory, pin
        no_nodes = pin(None, 0, sysfs_root="/nonexistent")
        # node {absent} is online in the tree but outside this process's cpuset mems
        absent = pin(None, {absent}, sysfs_root="{tmp_path}")
        off_node = pin([0], {absent}, sysfs_root="{tmp_path}")
        print(json.dumps({{"no_nodes": [no_nodes.memory, no_nodes.detail],
                           "absent": [absent.memory, absent.detail],
                           "off_node": off_node.detail,
                           "syscall": bind_memory(1023)}}))
        """
    )
    assert out["no_nodes"] == ["not available", "the kernel exposes no NUMA nodes"]
    assert out["absent"][0] == "not available"  # type: ignore[index]
    assert f"node {absent} is outside this process's cpuset mems" in out["absent"][1]  # type: ignore[index]
    assert f"CPU 0 is not on node {absent}: their memory accesses are remote" in str(out["off_node"])
    assert "set_mempolicy(MPOL_BIND, node 1023) failed: Invalid argument" in str(out["syscall"])


def test_pin_not_requested() -> None:
    out = run_isolated(
        """
        import json, os
        from worker.machine.pinning import pin
        before = sorted(os.sched_getaffinity(0))
        r = pin(None, None)
        print(json.dumps({"same": before == sorted(os.sched_getaffinity(0)), "summary": r.summary()}))
        """
    )
    assert out == {"same": True, "summary": "cpus not pinned, memory not requested"}


def test_pin_rejects_cpus_outside_allowed_set_and_keeps_mask() -> None:
    # pin() checks against what the process may be moved to (its cpuset), wider than the one core
    # a pinned runner hands down: the child runs on that whole set and takes its bad CPU from it
    out = run_isolated(
        """
        import json, os
        from tests.cpuset import cpuset_cpus
        wide = sorted(cpuset_cpus())
        os.sched_setaffinity(0, wide)
        from worker.machine.pinning import pin
        errors = []
        for cpus in ([0, max(wide) + 1], [], ):
            try:
                pin(cpus, None)
            except ValueError as e:
                errors.append(str(e))
        try:
            pin(None, 7, sysfs_root="FIXTURE")
        except ValueError as e:
            errors.append(str(e))
        print(json.dumps({"errors": errors, "wide": wide, "mask": sorted(os.sched_getaffinity(0))}))
        """.replace("FIXTURE", str(FIXTURES / "2node-16core-smt"))
    )
    wide = cast(list[int], out["wide"])
    bad, allowed = max(wide) + 1, format_cpu_list(wide)
    assert out["errors"] == [
        f"CPU {bad} is not in this process's allowed set {allowed} "
        "(check FLEET_CPUS / --cpus against the machine and its cpuset)",
        "empty CPU list: pass None to leave the affinity alone",
        "NUMA node 7 does not exist (online nodes: 0-1)",
    ]
    assert out["mask"] == wide
