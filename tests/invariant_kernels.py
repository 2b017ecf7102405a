"""Tests whose engines need batch-invariant kernels (`batch_invariant=True`). ggml fixes its
kernels for a whole process at the first model it loads, and which module of a pytest process
loads first depends on the order and, under xdist, on how tests are spread. So one rule: such
tests always run in a pytest process of their own, once a session, whoever asks first starting it
(the other xdist workers wait for its answer); each test here then takes its own verdict from
that run.

    @pytest.fixture(scope="module")
    def _engine() -> Iterator[LlamaCppBackend | None]:
        if not invariant_kernels.here():
            yield None
            return
        ...  # the engine, made only in the process of their own

    @pytest.fixture
    def engine(request, _engine):
        return invariant_kernels.engine_or_verdict(request, _engine)

    @invariant_kernels.verdict_elsewhere
    def test_x(engine): ...
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

OWN = "FLEET_TESTS_INVARIANT_KERNELS"  # set in the process of their own
RUN_SECONDS = 1200  # the run of a module's tests in their own process
SECONDS = RUN_SECONDS + 120  # a test's timeout: the one that starts the run waits for it
T = TypeVar("T")


@dataclass(frozen=True)
class Verdict:
    """A test's outcome in the process of its own: "passed", else what failed there."""

    test: str
    outcome: str


def here() -> bool:
    """True in the process of their own: the tests run here."""
    return os.environ.get(OWN) == "1"


def engine_or_verdict(request: pytest.FixtureRequest, made: T | None) -> T | Verdict:
    """`made` in the process of their own; elsewhere the asking test's verdict from there."""
    if made is not None:
        return made
    name = request.node.name
    outcomes = _run_once(request, request.fixturename or "")
    # a test that reaches the engines some other way than this fixture was not in the run
    assert name in outcomes, f"{name} was not run in the process of its own: ask for {request.fixturename}"
    return Verdict(name, outcomes[name])


def verdict_elsewhere(test: Callable[..., None]) -> Callable[..., None]:
    """The test's body where its engines are; elsewhere, its verdict from there."""
    @functools.wraps(test)
    def run(**fixtures: Any) -> None:
        verdicts = [v for v in fixtures.values() if isinstance(v, Verdict)]
        if not verdicts:
            test(**fixtures)
            return
        for verdict in verdicts:
            assert verdict.outcome == "passed", f"{verdict.test} in its own process:\n{verdict.outcome}"
    return run


def _run_once(request: pytest.FixtureRequest, fixture: str) -> dict[str, str]:
    """This module's tests that use `fixture`, run once a session in a fresh pytest process:
    test name -> outcome. Shared by the xdist workers through a locked file."""
    module = request.module
    items = [i for i in request.session.items
             if getattr(i, "module", None) is module and fixture in getattr(i, "fixturenames", ())]
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()  # this run's (per xdist worker)
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    answer = shared / f"invariant-kernels-{module.__name__}-{fixture}.json"
    with open(answer.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here for the first one's run
        if not answer.exists():
            answer.write_text(json.dumps(_run(request.config.rootpath, [i.nodeid for i in items],
                                              answer.with_suffix(".xml"))))
    outcomes: dict[str, str] = json.loads(answer.read_text())
    return outcomes


def _run(root: Path, nodeids: list[str], report: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {OWN: "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-p", "no:xdist", f"--junitxml={report}", *nodeids],
                              cwd=root, env=env, capture_output=True, text=True, timeout=RUN_SECONDS)
        said = f"rc {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    except subprocess.TimeoutExpired as e:  # the verdict of all of them: asked again, it would run again
        said = f"still running after {RUN_SECONDS}s:\n{e.stdout!r:.3000}"
    outcomes = {name: f"no verdict ({said})" for name in (n.split("::")[-1] for n in nodeids)}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            failed = [child for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name", "")] = ("passed" if not failed else
                                              "\n".join(f"{c.tag}: {c.get('message', '')}\n{c.text or ''}"
                                                        for c in failed)[-4000:])
    return outcomes
