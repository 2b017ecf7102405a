"""Topology -> placement plan: which worker runs on which cores of which NUMA node.

Rules (why: on CPU, throughput comes from batching in one context per memory domain, so workers
are few, big, and never share a core or straddle a node):
- The unit of allocation is a physical core. A worker's `threads` = the physical cores it owns.
- A worker's `cpus` are the first thread of each of its cores; with `smt=True` also the SMT
  siblings (llama.cpp still runs one thread per core: decode is memory-bound and two compute
  threads on one core slow it down, but the siblings give the OS room for the worker's Python
  side). A core whose first thread is not usable (offline, outside the cpuset) is used through
  the thread that is.
- A worker never straddles NUMA nodes; cores are taken in CPU-number order within a node.
- `reserve_cores` whole cores are kept free at the end of node 0 (Redis, the OS).
- workers="auto": one worker per node with all its free cores (or, with cores_per_worker, as
  many such workers as fit). workers=N: spread over nodes in proportion to their free cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ecosystem.topology import Core, Topology
from worker.settings import format_cpu_list

Workers = int | Literal["auto"]


class PlanError(ValueError):
    """The request cannot be placed on this machine; the message names the numbers."""


@dataclass(frozen=True)
class WorkerPlan:
    name: str
    cpus: tuple[int, ...]
    numa_node: int | None  # None: the machine exposes no NUMA information
    threads: int  # = physical cores owned
    slots: int
    cores: tuple[tuple[int, ...], ...] = field(default=(), compare=False)  # for display
    # whether the engine takes a thread count (llama-cpp): any other refuses backend.threads
    engine_threads: bool = True

    @property
    def cpu_list(self) -> str:
        return format_cpu_list(list(self.cpus))

    def env(self) -> dict[str, str]:
        """FLEET_* overrides that place a `fleet worker` as planned (see worker.settings)."""
        env = {
            "FLEET_NAME": self.name,
            "FLEET_CPUS": self.cpu_list,
            "FLEET_BACKEND__SLOTS": str(self.slots),
        }
        if self.engine_threads:
            env["FLEET_BACKEND__THREADS"] = str(self.threads)
        if self.numa_node is not None:
            env["FLEET_NUMA_NODE"] = str(self.numa_node)
        return env

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "cpus": self.cpu_list,
            "numa_node": self.numa_node,
            "threads": self.threads,
            "slots": self.slots,
        }


@dataclass(frozen=True)
class Plan:
    workers: tuple[WorkerPlan, ...]
    reserved_cpus: tuple[int, ...]
    smt: bool
    topology_summary: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            "topology": self.topology_summary,
            "smt": self.smt,
            "reserved_cpus": format_cpu_list(list(self.reserved_cpus)) if self.reserved_cpus else "",
            "workers": [w.to_dict() for w in self.workers],
            "notes": list(self.notes),
        }


def plan(
    topology: Topology,
    workers: Workers = "auto",
    cores_per_worker: int | None = None,
    slots: int = 16,
    reserve_cores: int = 0,
    smt: bool = False,
    name_prefix: str = "worker",
    engine_threads: bool = True,
) -> Plan:
    """`engine_threads`: the workers' engine takes `backend.threads` (llama-cpp, the default)."""
    if workers != "auto" and (not isinstance(workers, int) or workers < 1):
        raise PlanError(f"workers must be a positive integer or 'auto', got {workers!r}")
    if cores_per_worker is not None and cores_per_worker < 1:
        raise PlanError(f"cores_per_worker must be at least 1, got {cores_per_worker}")
    if slots < 1:
        raise PlanError(f"slots must be at least 1, got {slots}")
    if reserve_cores < 0:
        raise PlanError(f"reserve_cores must be 0 or more, got {reserve_cores}")

    free, reserved = _free_cores(topology, reserve_cores)
    total_free = sum(len(cores) for cores in free.values())
    if total_free == 0:
        raise PlanError(
            f"zero cores left: the machine has {len(topology.cores)} physical cores and "
            f"{reserve_cores} are reserved"
        )

    if cores_per_worker is None:
        sizes = _sizes_without_cpw(free, workers, total_free)
    else:
        sizes = _sizes_with_cpw(free, workers, cores_per_worker)

    placed: list[WorkerPlan] = []
    for node_id in sorted(sizes):
        start = 0
        for size in sizes[node_id]:
            cores = free[node_id][start : start + size]
            start += size
            cpus = sorted(c for core in cores for c in (core.cpus if smt else (core.primary,)))
            placed.append(
                WorkerPlan(
                    name=f"{name_prefix}-{len(placed)}",
                    cpus=tuple(cpus),
                    numa_node=node_id if topology.numa else None,
                    threads=size,
                    slots=slots,
                    cores=tuple(core.cpus for core in cores),
                    engine_threads=engine_threads,
                )
            )
    notes = list(topology.notes)
    unused = total_free - sum(w.threads for w in placed)
    if unused:
        notes.append(f"{unused} free physical core(s) left unused by this plan")
    return Plan(
        workers=tuple(placed),
        reserved_cpus=tuple(sorted(c for core in reserved for c in core.cpus)),
        smt=smt,
        topology_summary=topology.summary(),
        notes=tuple(notes),
    )


def _free_cores(topology: Topology, reserve_cores: int) -> tuple[dict[int, list[Core]], list[Core]]:
    """Cores per node after taking `reserve_cores` from the end of the first node."""
    free = {n.id: list(n.cores) for n in topology.nodes}
    first = topology.nodes[0]
    if reserve_cores > len(first.cores):
        raise PlanError(
            f"reserve_cores={reserve_cores} but node {first.id} has only {len(first.cores)} "
            "physical cores (reserved cores are taken from the end of the first node)"
        )
    reserved = free[first.id][len(first.cores) - reserve_cores :]
    free[first.id] = free[first.id][: len(first.cores) - reserve_cores]
    return free, reserved


def _describe_free(free: dict[int, list[Core]]) -> str:
    return ", ".join(f"node {nid}: {len(cores)}" for nid, cores in sorted(free.items()))


def _split(cores: int, workers: int) -> list[int]:
    """Equal shares, the first workers taking the remainder: 16 over 3 -> [6, 5, 5]."""
    base, extra = divmod(cores, workers)
    return [base + (1 if i < extra else 0) for i in range(workers)]


def _sizes_without_cpw(
    free: dict[int, list[Core]], workers: Workers, total_free: int
) -> dict[int, list[int]]:
    if workers == "auto":
        # A node emptied by the reservation simply gets no worker (plan() notes the idle node).
        return {nid: [len(cores)] for nid, cores in free.items() if cores}
    if workers > total_free:
        raise PlanError(
            f"{workers} workers requested but only {total_free} free physical cores "
            f"({_describe_free(free)}); a worker needs at least one whole core"
        )
    # Give each next worker to the node where it would get the most cores (ties: lowest node),
    # so workers come out as equal as node boundaries allow.
    counts = dict.fromkeys(free, 0)
    for _ in range(workers):
        best = max(sorted(free), key=lambda nid: len(free[nid]) / (counts[nid] + 1))
        counts[best] += 1
    return {nid: _split(len(free[nid]), n) for nid, n in counts.items() if n}


def _sizes_with_cpw(free: dict[int, list[Core]], workers: Workers, cpw: int) -> dict[int, list[int]]:
    largest = max(len(cores) for cores in free.values())
    if cpw > largest:
        biggest = max(sorted(free), key=lambda nid: len(free[nid]))
        raise PlanError(
            f"cores_per_worker={cpw} would straddle NUMA nodes: the largest node (node {biggest}) "
            f"has {largest} free physical cores ({_describe_free(free)})"
        )
    capacity = {nid: len(cores) // cpw for nid, cores in free.items()}
    fit = sum(capacity.values())
    if workers == "auto":
        return {nid: [cpw] * n for nid, n in capacity.items() if n}
    if workers > fit:
        raise PlanError(
            f"{workers} workers x {cpw} cores do not fit: only {fit} worker(s) of {cpw} cores fit "
            f"without straddling NUMA nodes (free physical cores per node: {_describe_free(free)})"
        )
    # Spread over nodes: each next worker goes where the most cores are still free.
    left = {nid: len(cores) for nid, cores in free.items()}
    counts = dict.fromkeys(free, 0)
    for _ in range(workers):
        best = max(sorted(free), key=lambda nid: left[nid])
        left[best] -= cpw
        counts[best] += 1
    return {nid: [cpw] * n for nid, n in counts.items() if n}
