"""What the machine looks like: online CPUs, physical cores (SMT siblings grouped), NUMA nodes.

Read from sysfs so that tests can point `root` at recorded trees of machines we do not have:

    <root>/devices/system/cpu/online                                   "0-63"
    <root>/devices/system/cpu/cpuN/topology/thread_siblings_list       "0,32"
    <root>/devices/system/cpu/cpuN/topology/{core_id,physical_package_id}
    <root>/devices/system/node/online, nodeN/cpulist                   "0-15,32-47"

A physical core is identified by its sibling set (core_id alone repeats across packages).
Missing pieces degrade instead of failing: no node dir -> one node holding every CPU; no cpu dir
-> psutil's count, each CPU its own core. Each fallback leaves a note the CLI prints.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from worker.settings import format_cpu_list, parse_cpu_list


@dataclass(frozen=True)
class Core:
    """One physical core: its online hardware threads, lowest CPU number first."""

    cpus: tuple[int, ...]
    node: int
    package: int = 0
    core_id: int = 0

    @property
    def primary(self) -> int:
        """The thread a worker uses when SMT siblings are left out."""
        return self.cpus[0]

    @property
    def siblings(self) -> tuple[int, ...]:
        return self.cpus[1:]


@dataclass(frozen=True)
class NumaNode:
    id: int
    cores: tuple[Core, ...]  # ordered by primary CPU number

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(c for core in self.cores for c in core.cpus))


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]  # nodes that have usable CPUs, by id
    numa: bool  # False when the kernel exposed no node information (NUMA binding meaningless)
    source: str  # "sysfs:<root>" or "psutil"
    notes: tuple[str, ...] = field(default=())

    @property
    def cores(self) -> tuple[Core, ...]:
        return tuple(core for node in self.nodes for core in node.cores)

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(c for node in self.nodes for c in node.cpus))

    @property
    def smt(self) -> bool:
        return any(len(core.cpus) > 1 for core in self.cores)

    def node(self, node_id: int) -> NumaNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(f"no NUMA node {node_id} (nodes: {', '.join(str(n.id) for n in self.nodes)})")

    def summary(self) -> str:
        """'2 nodes, 32 cores, 64 CPUs (SMT)'."""
        n = len(self.nodes)
        smt = " (SMT)" if self.smt else ""
        return f"{n} node{'s' if n != 1 else ''}, {len(self.cores)} cores, {len(self.cpus)} CPUs{smt}"

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "numa": self.numa,
            "nodes": [
                {
                    "id": n.id,
                    "cpus": format_cpu_list(list(n.cpus)),
                    "cores": [list(core.cpus) for core in n.cores],
                }
                for n in self.nodes
            ],
            "notes": list(self.notes),
        }


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _cpu_dirs(cpu_root: Path) -> list[int]:
    ids = []
    for entry in cpu_root.glob("cpu[0-9]*"):
        suffix = entry.name[3:]
        if suffix.isdigit():
            ids.append(int(suffix))
    return sorted(ids)


def _online_cpus(cpu_root: Path, notes: list[str]) -> list[int]:
    text = _read(cpu_root / "online")
    if text:
        return parse_cpu_list(text)
    # Old or trimmed trees: every cpuN directory that has topology counts as online.
    notes.append(f"{cpu_root}/online missing: treating every cpuN with topology as online")
    return [c for c in _cpu_dirs(cpu_root) if (cpu_root / f"cpu{c}" / "topology").is_dir()]


def _node_cpus(node_root: Path, notes: list[str]) -> dict[int, set[int]] | None:
    if not node_root.is_dir():
        return None
    online = _read(node_root / "online")
    if online:
        node_ids = parse_cpu_list(online)
    else:
        node_ids = sorted(int(p.name[4:]) for p in node_root.glob("node[0-9]*") if p.name[4:].isdigit())
    result: dict[int, set[int]] = {}
    for nid in node_ids:
        text = _read(node_root / f"node{nid}" / "cpulist")
        if text is None:
            notes.append(f"node{nid}/cpulist missing: node ignored")
            continue
        # An empty cpulist is a memory-only node (e.g. CXL/HBM): no workers can run there.
        result[nid] = set(parse_cpu_list(text)) if text else set()
    return result or None


def read_topology(root: str | os.PathLike[str] = "/sys", allowed: Iterable[int] | None = None) -> Topology:
    """Topology of the machine whose sysfs is at `root`.

    `allowed` restricts it to the CPUs this process may run on (pass `os.sched_getaffinity(0)`
    for the live machine inside a cpuset/container); CPUs outside it are dropped, and a core
    keeps only its allowed threads.
    """
    sys_root = Path(root)
    cpu_root = sys_root / "devices" / "system" / "cpu"
    notes: list[str] = []
    allowed_set = set(allowed) if allowed is not None else None

    if not cpu_root.is_dir():
        return _psutil_topology(f"{cpu_root} missing", allowed_set)

    online = _online_cpus(cpu_root, notes)
    if allowed_set is not None:
        dropped = sorted(set(online) - allowed_set)
        if dropped:
            notes.append(f"CPUs {format_cpu_list(dropped)} are outside this process's affinity: ignored")
        online = [c for c in online if c in allowed_set]
    if not online:
        return _psutil_topology(f"no usable CPUs under {cpu_root}", allowed_set)
    online_set = set(online)

    node_cpus = _node_cpus(sys_root / "devices" / "system" / "node", notes)
    numa = node_cpus is not None
    if node_cpus is None:
        notes.append("no NUMA information (devices/system/node missing): one node holds every CPU")
        node_cpus = {0: set(online)}
    cpu_node: dict[int, int] = {c: nid for nid, cpus in node_cpus.items() for c in cpus}
    orphans = sorted(online_set - cpu_node.keys())
    if orphans:
        first = min(node_cpus)
        notes.append(f"CPUs {format_cpu_list(orphans)} belong to no node: counted in node {first}")
        cpu_node.update({c: first for c in orphans})

    cores: dict[tuple[int, ...], Core] = {}
    for cpu in online:
        topo = cpu_root / f"cpu{cpu}" / "topology"
        siblings_text = _read(topo / "thread_siblings_list") or _read(topo / "core_cpus_list")
        siblings = parse_cpu_list(siblings_text) if siblings_text else [cpu]
        if not siblings_text:
            notes.append(f"cpu{cpu}: no thread_siblings_list, treated as its own core")
        usable = tuple(sorted((set(siblings) & online_set) | {cpu}))
        if usable in cores:
            continue
        nodes_of_core = {cpu_node[c] for c in usable}
        if len(nodes_of_core) > 1:  # firmware nonsense; keep the core on its first thread's node
            notes.append(f"core {format_cpu_list(list(usable))} spans nodes {sorted(nodes_of_core)}")
        cores[usable] = Core(
            cpus=usable,
            node=cpu_node[usable[0]],
            package=_read_int(topo / "physical_package_id") or 0,
            core_id=_read_int(topo / "core_id") or 0,
        )

    nodes = tuple(
        NumaNode(id=nid, cores=tuple(sorted((c for c in cores.values() if c.node == nid), key=_core_key)))
        for nid in sorted(node_cpus)
    )
    empty = [n.id for n in nodes if not n.cores]
    if empty and numa:
        notes.append(f"nodes {empty} have no usable CPUs (memory-only or not allowed): no workers there")
    return Topology(
        nodes=tuple(n for n in nodes if n.cores), numa=numa, source=f"sysfs:{sys_root}", notes=tuple(notes)
    )


def _core_key(core: Core) -> int:
    return core.primary


def _psutil_topology(reason: str, allowed: set[int] | None) -> Topology:
    """No sysfs: psutil's counts, each logical CPU its own core, one node (sibling pairs unknown)."""
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False)
    cpus = [c for c in range(logical) if allowed is None or c in allowed] or sorted(allowed or {0})
    notes = [
        f"{reason}: psutil reports {logical} logical / {physical or '?'} physical CPUs; "
        "each CPU treated as its own core on one node"
    ]
    cores = tuple(Core(cpus=(c,), node=0, core_id=c) for c in cpus)
    return Topology(nodes=(NumaNode(id=0, cores=cores),), numa=False, source="psutil", notes=tuple(notes))
