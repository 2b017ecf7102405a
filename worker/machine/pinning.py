"""Pin this worker process to its CPUs and bind its memory to its NUMA node.

Call `pin()` first thing in the worker, from the main thread, before the model loads and before
any thread starts: the CPU mask and the memory policy are per thread and are inherited by the
threads created afterwards (llama.cpp's thread pool, the heartbeat thread). Threads that already
exist get the CPU mask too (we walk /proc/self/task), but not the memory policy.

Memory binding is best effort: `set_mempolicy(MPOL_BIND)` through the raw syscall (libnuma only
on architectures whose syscall number we do not know). It never raises for missing NUMA support;
the report says what happened. Only requests that are wrong raise ValueError: CPUs this process
may not use, or a node that does not exist on a multi-node machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.settings import format_cpu_list, parse_cpu_list

MemoryOutcome = Literal["bound", "not available", "single node", "not requested"]

MPOL_BIND = 2
# (set_mempolicy, get_mempolicy) syscall numbers; riscv64 and aarch64 share the generic table.
_SYSCALLS: dict[str, tuple[int, int]] = {
    "x86_64": (238, 239),
    "aarch64": (237, 236),
    "riscv64": (237, 236),
    "ppc64le": (261, 260),
    "ppc64": (261, 260),
    "s390x": (270, 269),
    "i686": (276, 275),
}


@dataclass(frozen=True)
class PinReport:
    cpus: tuple[int, ...] | None  # the affinity now in effect, None when not requested
    numa_node: int | None
    memory: MemoryOutcome
    detail: str = ""  # why memory is not bound, or a warning about the request

    @property
    def cpu_list(self) -> str | None:
        return format_cpu_list(list(self.cpus)) if self.cpus else None

    def summary(self) -> str:
        """One log line: 'cpus 0-15, memory bound to node 0'."""
        cpus = f"cpus {self.cpu_list}" if self.cpus else "cpus not pinned"
        bound = self.memory == "bound"
        mem = f"memory bound to node {self.numa_node}" if bound else f"memory {self.memory}"
        return f"{cpus}, {mem}" + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict[str, str]:
        """Flat strings, ready for the worker's status hash."""
        return {
            "cpus": self.cpu_list or "",
            "numa_node": "" if self.numa_node is None else str(self.numa_node),
            "numa_memory": self.memory,
            "numa_detail": self.detail,
        }


def pin(
    cpus: list[int] | None, numa_node: int | None, *, sysfs_root: str | os.PathLike[str] = "/sys"
) -> PinReport:
    """Set this process's CPU affinity to `cpus` and bind memory to `numa_node` (each optional)."""
    pinned = _set_affinity(cpus) if cpus is not None else None
    if numa_node is None:
        return PinReport(pinned, None, "not requested")
    if numa_node < 0:
        raise ValueError(f"NUMA node must be 0 or more, got {numa_node}")

    node_root = Path(sysfs_root) / "devices" / "system" / "node"
    online_text = _read(node_root / "online")
    if online_text is None:
        return PinReport(pinned, numa_node, "not available", "the kernel exposes no NUMA nodes")
    nodes = parse_cpu_list(online_text)
    warning = _cpus_off_node(pinned, numa_node, node_root)
    if len(nodes) == 1:
        detail = "" if numa_node == nodes[0] else f"node {numa_node} requested, the only node is {nodes[0]}"
        return PinReport(pinned, numa_node, "single node", _join(detail, warning))
    if numa_node not in nodes:
        raise ValueError(f"NUMA node {numa_node} does not exist (online nodes: {online_text})")
    mems = _mems_allowed()
    if mems is not None and numa_node not in mems:
        why = f"node {numa_node} is outside this process's cpuset mems ({format_cpu_list(sorted(mems))})"
        return PinReport(pinned, numa_node, "not available", _join(why, warning))
    error = bind_memory(numa_node)
    if error:
        return PinReport(pinned, numa_node, "not available", _join(error, warning))
    return PinReport(pinned, numa_node, "bound", warning)


def _set_affinity(cpus: list[int]) -> tuple[int, ...]:
    wanted = set(cpus)
    if not wanted:
        raise ValueError("empty CPU list: pass None to leave the affinity alone")
    allowed = _allowed_cpus()
    outside = sorted(wanted - allowed)
    if outside:
        raise ValueError(
            f"{_cpus(outside)} not in this process's allowed set "
            f"{format_cpu_list(sorted(allowed))} (check FLEET_CPUS / --cpus against the machine and "
            "its cpuset)"
        )
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, wanted)
    got = os.sched_getaffinity(0)
    if got != wanted:  # the kernel silently drops CPUs outside the cpuset
        os.sched_setaffinity(0, previous)
        raise ValueError(
            f"asked for CPUs {format_cpu_list(sorted(wanted))} but the kernel allowed only "
            f"{format_cpu_list(sorted(got))}"
        )
    # Threads started before pin() (imports that spawn helpers) would otherwise keep the old mask.
    for task in _tasks():
        with contextlib.suppress(ProcessLookupError, PermissionError):  # thread exited meanwhile
            os.sched_setaffinity(task, wanted)
    return tuple(sorted(got))


def _tasks() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    except OSError:
        return []


def _allowed_cpus() -> set[int]:
    """CPUs this process may be moved to: its cpuset if readable (wider than a mask it inherited
    from taskset/systemd), else its current mask."""
    for path in _cpuset_files():
        text = _read(path)
        if text:
            return set(parse_cpu_list(text))
    return os.sched_getaffinity(0)


def _cpuset_files() -> list[Path]:
    lines = (_read(Path("/proc/self/cgroup")) or "").splitlines()
    files = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, cg_path = rest.partition(":")
        cg = cg_path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            files.append(Path("/sys/fs/cgroup") / cg / "cpuset.cpus.effective")  # cgroup v2
        elif "cpuset" in controllers.split(","):
            files.append(Path("/sys/fs/cgroup/cpuset") / cg / "cpuset.effective_cpus")  # v1
    return files


def _mems_allowed() -> set[int] | None:
    for line in (_read(Path("/proc/self/status")) or "").splitlines():
        if line.startswith("Mems_allowed_list:"):
            return set(parse_cpu_list(line.split(":", 1)[1]))
    return None


def _cpus_off_node(cpus: tuple[int, ...] | None, node: int, node_root: Path) -> str:
    """A warning (not an error: it may be deliberate) when pinned CPUs are on another node."""
    node_cpus_text = _read(node_root / f"node{node}" / "cpulist")
    if not cpus or not node_cpus_text:
        return ""
    off = sorted(set(cpus) - set(parse_cpu_list(node_cpus_text)))
    if not off:
        return ""
    return f"{_cpus(off)} not on node {node}: their memory accesses are remote"


def _cpus(cpus: list[int]) -> str:
    """'CPU 5 is' / 'CPUs 4-7 are'."""
    return f"CPU {cpus[0]} is" if len(cpus) == 1 else f"CPUs {format_cpu_list(cpus)} are"


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _nodemask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """A nodemask with `node` set and the maxnode to pass with it (bits + 1, as libnuma does:
    the kernel reads maxnode - 1 bits)."""
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    return mask, words * bits + 1


def bind_memory(node: int) -> str:
    """set_mempolicy(MPOL_BIND, {node}) for the calling thread. Returns '' or why it failed."""
    mask, maxnode = _nodemask(node)
    numbers = _SYSCALLS.get(platform.machine())
    libc = ctypes.CDLL(None, use_errno=True)
    if numbers is not None:
        # Every variadic argument passed at full register width: syscall() reads them as longs.
        rc = libc.syscall(ctypes.c_long(numbers[0]), ctypes.c_long(MPOL_BIND), mask, ctypes.c_ulong(maxnode))
    else:
        libnuma_name = ctypes.util.find_library("numa")
        if libnuma_name is None:
            return f"set_mempolicy: unknown syscall number on {platform.machine()} and no libnuma"
        libnuma = ctypes.CDLL(libnuma_name, use_errno=True)
        rc = libnuma.set_mempolicy(MPOL_BIND, mask, ctypes.c_ulong(maxnode))
    if rc != 0:
        err = ctypes.get_errno()
        return f"set_mempolicy(MPOL_BIND, node {node}) failed: {os.strerror(err)} (errno {err})"
    return ""


def memory_policy() -> tuple[int, list[int]] | None:
    """(mode, nodes) of the calling thread's memory policy via get_mempolicy; None if unknown."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = 16  # 1024 nodes: more than any kernel's nr_node_ids, which get_mempolicy requires
    mask = (ctypes.c_ulong * words)()
    mode = ctypes.c_int(-1)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(
        ctypes.c_long(numbers[1]),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(words * bits + 1),
        ctypes.c_void_p(None),
        ctypes.c_ulong(0),
    )
    if rc != 0:
        return None
    nodes = [w * bits + b for w in range(words) for b in range(bits) if mask[w] >> b & 1]
    return mode.value, nodes
