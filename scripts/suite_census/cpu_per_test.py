"""A pytest plugin for scripts/suite_census.py: each test's wall seconds and the CPU seconds it
and the processes it started and reaped used, one JSON line a test in $SUITE_CENSUS_TESTS."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import pytest


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    wall, cpu = time.perf_counter(), _cpu()
    yield
    line = {"test": item.nodeid, "wall": round(time.perf_counter() - wall, 2), "cpu": round(_cpu() - cpu, 2)}
    fd = os.open(os.environ["SUITE_CENSUS_TESTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)
