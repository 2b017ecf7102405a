"""One llama.cpp build for both engines (scripts/build-llama-server), and llama-server built on
demand when `scripts/setup --demo` left it out."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from ecosystem.local import llama_server
from ecosystem.local.llama_server import LLAMA_CPP_PYTHON_VERSION, llama_server_binary


def _fake_build_script(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_missing_llama_server_is_built_by_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("FLEET_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("LLAMA_CPP_PYTHON_VERSION", raising=False)
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "cache"))
    # what the real script does, in short: build into the versioned cache dir, print the path last
    script = _fake_build_script(tmp_path / "build-llama-server", """
bin="$FLEET_CACHE_DIR/llama.cpp-$LLAMA_CPP_PYTHON_VERSION/bin"
mkdir -p "$bin"
echo "building (progress goes to stderr)" >&2
printf '#!/bin/sh\\n' > "$bin/llama-server"; chmod +x "$bin/llama-server"
echo "$bin/llama-server"
""")
    monkeypatch.setattr(llama_server, "BUILD_SCRIPT", script)
    expected = tmp_path / "cache" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "bin" / "llama-server"
    assert llama_server_binary() == expected
    err = capfd.readouterr().err
    assert "is not built yet: building it now" in err and "building (progress goes to stderr)" in err
    # built once: the next call finds it without running the script
    script.write_text("#!/bin/sh\nexit 1\n")
    assert llama_server_binary() == expected


def test_a_failed_build_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEET_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "cache"))
    script = _fake_build_script(tmp_path / "build-llama-server", "echo 'cmake: no compiler' >&2; exit 3\n")
    monkeypatch.setattr(llama_server, "BUILD_SCRIPT", script)
    with pytest.raises(RuntimeError, match=r"failed \(exit 3"):
        llama_server_binary()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.skipif(bool(os.environ.get("FLEET_LLAMA_SERVER")),
                    reason="FLEET_LLAMA_SERVER names another binary")
def test_llama_server_and_the_in_process_backend_load_the_same_libllama() -> None:
    import llama_cpp

    binary = llama_server_binary()  # scripts/setup built it (scripts/test runs setup)
    libdir = binary.parent.parent / "lib"
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    loaded = {line.split()[0]: Path(line.split()[2]) for line in ldd.splitlines() if "=>" in line
              and len(line.split()) > 2 and line.split()[2].startswith("/")}
    python_libs = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libllama.so.0", "libggml.so.0", "libggml-base.so.0", "libggml-cpu.so.0"):
        assert loaded[name].resolve().parent == libdir.resolve(), (name, loaded[name])
        assert _sha(loaded[name]) == _sha(python_libs / name), f"{name}: another build than llama_cpp's"
