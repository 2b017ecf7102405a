"""The `model` marker kept true. A test not marked `model` that loads the real model's weights in
this process, or starts a real-model `fleet worker` / `fleet up`, a llama-server or a supervisor of
them, fails at that call and is told to take the marker: so the fast tier (`scripts/test --fast`,
`-m "not model"`) never runs the model, and the marker cannot go stale as tests change.
A vocabulary-only load (a tokenizer) is not the model."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MARK = "model"
SUPERVISORS = {"pm2", "supervisord", "systemd-run"}
_unmarked: list[str] = []  # the running test's id while it is not marked `model`


class NeedsModelMark(RuntimeError):
    pass


def starts_model(argv: Sequence[object], env: Mapping[str, str] | None) -> bool:
    words = [os.path.basename(str(a)) for a in argv]
    if not words:
        return False
    if words[0] == "llama-server":
        return True
    fake = (env if env is not None else os.environ).get("FLEET_BACKEND__TYPE") == "fake"
    if words[0] in SUPERVISORS or (len(words) > 1 and words[1] in SUPERVISORS):
        return not fake
    if "ecosystem.cli" in words:
        command = words[words.index("ecosystem.cli") + 1:][:1]
    elif len(words) > 1 and words[1] == "fleet":
        command = words[2:3]
    else:
        return False
    return command in (["worker"], ["up"]) and not fake


def refuse(what: str) -> None:
    if _unmarked:
        raise NeedsModelMark(f"{_unmarked[0]} {what} but is not marked `model`: mark it "
                             "(`pytestmark = pytest.mark.model` or `@pytest.mark.model`)")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "subprocess.Popen" and _unmarked:
        _executable, argv, _cwd, env = args
        if starts_model(list(argv) if isinstance(argv, (list, tuple)) else [argv], env):
            refuse(f"starts the real model ({' '.join(map(str, list(argv)[:4]))})")


def install() -> None:
    """Watch this process: subprocess starts (an audit hook) and in-process weight loads."""
    sys.addaudithook(_audit)
    try:
        from backends.llamacpp import engine, model
    except ImportError:  # no llama-cpp-python here: nothing in this process can load weights
        return
    real: Callable[..., Any] = model.load_weights

    def load_weights(path: Any) -> Any:
        refuse("loads the real model's weights")
        return real(path)

    model.load_weights = load_weights
    engine.load_weights = load_weights


def running(nodeid: str, marked: bool) -> None:
    _unmarked[:] = [] if marked else [nodeid]
