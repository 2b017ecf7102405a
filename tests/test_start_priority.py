"""A starting worker runs nicer until it serves, then every thread made meanwhile is back at the
process's own priority, except one that chose its own (the KV store's writer at 19). The hung
worker test (tests/test_hung_worker.py) shows what it is for: streams on serving workers keep
their pace while a restarted worker loads."""

from __future__ import annotations

import os
import threading

from worker.machine.priority import may_lower_to, starting_gently


def nice_of(tid: int = 0) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def run_in_thread(start_nice: int) -> dict[str, int]:
    """starting_gently on a fresh thread (the test process's own niceness stays untouched)."""
    seen: dict[str, int] = {}

    def body() -> None:
        own = nice_of()
        seen["own"] = own
        made = threading.Event()
        ends = threading.Event()
        tids: dict[str, int] = {}

        def child(name: str, chooses: int | None) -> None:
            tids[name] = threading.get_native_id()
            if chooses is not None:
                os.setpriority(os.PRIO_PROCESS, 0, chooses)
            made.set()
            ends.wait(10)

        with starting_gently(start_nice):
            seen["during"] = nice_of()
            made_threads = [threading.Thread(target=child, args=("pool", None)),
                            threading.Thread(target=child, args=("writer", 19))]
            for t in made_threads:
                made.clear()
                t.start()
                made.wait(10)
            seen["pool_during"] = nice_of(tids["pool"])
        seen["after"] = nice_of()
        seen["pool_after"] = nice_of(tids["pool"])
        seen["writer_after"] = nice_of(tids["writer"])
        ends.set()
        for t in made_threads:
            t.join()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen


def test_a_start_runs_nicer_and_every_thread_comes_back() -> None:
    assert may_lower_to(nice_of())  # the suite runs as root (network namespaces need it too)
    seen = run_in_thread(10)
    own = seen["own"]
    assert seen["during"] == min(19, own + 10) and seen["pool_during"] == seen["during"]
    assert seen["after"] == own and seen["pool_after"] == own  # back, the threads made meanwhile too
    assert seen["writer_after"] == 19  # a thread that chose its own keeps it


def test_zero_leaves_the_priority_alone() -> None:
    seen = run_in_thread(0)
    assert seen["during"] == seen["own"] == seen["after"] == seen["pool_after"]
