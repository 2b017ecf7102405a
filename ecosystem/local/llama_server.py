"""A local `llama-server` process on the real model, for `fleet bench` and the tests.

The binary is llama.cpp's server built from the llama.cpp vendored in the pinned llama-cpp-python,
in the same CMake tree as the shared libraries the in-process backend loads and linked against
them (scripts/build-llama-server, cached by version in the cache dir), so the server and the
in-process backend run the same llama.cpp. scripts/setup builds it for the tests; after
`scripts/setup --demo` (which does not) the first caller here builds it. $FLEET_LLAMA_SERVER names
another binary; a `llama-server` on PATH is the last resort, when there is no build script.

    with start_llama_server(log_dir, parallel=4, ctx=4096, threads=2) as srv:  # waits for /health
        httpx.post(f"{srv.url}/completion", json={...})
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from backends.model import cache_dir, default_model_path
from ecosystem.local.processes import free_port

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the pin in pyproject.toml; scripts/build-llama-server's default
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-llama-server"


def llama_server_binary() -> Path:
    """$FLEET_LLAMA_SERVER, else the build cached in the cache dir (built now when missing and this
    is a checkout with scripts/build-llama-server: minutes, once), else `llama-server` on PATH."""
    if env := os.environ.get("FLEET_LLAMA_SERVER"):
        return Path(env)
    version = os.environ.get("LLAMA_CPP_PYTHON_VERSION", LLAMA_CPP_PYTHON_VERSION)
    cached = cache_dir() / f"llama.cpp-{version}" / "bin" / "llama-server"
    if os.access(cached, os.X_OK):
        return cached
    if os.access(BUILD_SCRIPT, os.X_OK):
        return build_llama_server(version)
    if found := shutil.which("llama-server"):
        return Path(found)
    raise RuntimeError(f"no llama-server at {cached} nor on PATH: run scripts/build-llama-server "
                       "(scripts/setup does), or set FLEET_LLAMA_SERVER")


def build_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Run scripts/build-llama-server (its progress on stderr) and return the binary it built.
    Concurrent callers wait for one build (the script holds a lock per version)."""
    print(f"llama-server {version} is not built yet: building it now with {BUILD_SCRIPT} "
          "(once, a few minutes on 2 cores; its progress follows on stderr)", file=sys.stderr, flush=True)
    env = {**os.environ, "FLEET_CACHE_DIR": str(cache_dir()), "LLAMA_CPP_PYTHON_VERSION": version}
    env.setdefault("PYTHON", sys.executable)
    done = subprocess.run([str(BUILD_SCRIPT)], env=env, stdout=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    binary = Path(lines[-1]) if lines else None
    if done.returncode != 0 or binary is None or not os.access(binary, os.X_OK):
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {done.returncode}; what went wrong is above "
                           "on stderr): llama-server is needed here, or set FLEET_LLAMA_SERVER")
    print(f"llama-server built: {binary}", file=sys.stderr, flush=True)
    return binary


@dataclass
class LlamaServer:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, like a crash: no goodbye to open streams."""
        if self.alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"llama-server exited: {self.log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama-server not healthy after {timeout}s: {self.log.read_text()[-2000:]}")


# What ggml's AMX kernels do: LDTILECFG [rdi]; TILEZERO tmm0; TILERELEASE; RET, in a process that
# has not asked Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM): the llama.cpp pinned here
# does not ask, and a Linux that wants the request (5.16+) answers the first tile instruction with
# SIGILL, as llama-server's first decode got on a Xeon Sapphire Rapids (KVM guest).
_AMX_PROBE = """
import ctypes, mmap
code = bytes([0xc4, 0xe2, 0x78, 0x49, 0x07, 0xc4, 0xe2, 0x7b, 0x49, 0xc0,
              0xc4, 0xe2, 0x78, 0x49, 0xc0, 0xc3])
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(code)
config = (ctypes.c_ubyte * 64)()
config[0], config[16], config[48] = 1, 64, 16  # palette 1; tile 0: 64 bytes x 16 rows
run = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
run(ctypes.addressof(config))
"""


@functools.cache
def amx_unusable() -> bool:
    """The CPU says it has AMX but a tile instruction kills a process that did not ask for it.
    llama-server's weight repacking then picks ggml's AMX kernels and dies at its first decode
    (SIGILL), so it must start with `--no-repack` (the in-process engine never repacks:
    use_extra_bufts off)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if " amx_tile" not in flags:
        return False
    probe = subprocess.run([sys.executable, "-c", _AMX_PROBE], capture_output=True, timeout=30)
    return probe.returncode != 0


def peer_flags() -> list[str]:
    """Flags llama-server needs on this machine to run at all (see amx_unusable)."""
    return ["--no-repack"] if amx_unusable() else []


def start_llama_server(
    log_dir: Path,
    *,
    parallel: int,
    ctx: int,
    threads: int,
    port: int | None = None,
    model: Path | None = None,
    wait: bool = True,
    extra_args: Sequence[str] = (),
    cpus: Sequence[int] = (),
) -> LlamaServer:
    """`llama-server -m MODEL -np PARALLEL -c CTX -t THREADS --slots --jinja [EXTRA_ARGS]` on
    127.0.0.1 (a free port unless given); the log goes to log_dir. Waits for /health unless `wait`
    is False. `--jinja` (the pinned llama.cpp's default, said so that another build does the same)
    comes before EXTRA_ARGS: a `--chat-template-file` there is read as Jinja only after it, and a
    `--no-jinja` there turns it off.
    `cpus`: the cores it may run on, set before it starts (its threads inherit the mask; pinning
    a running server would move its main thread only)."""
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"llama-server-{port}.log"
    args = [str(llama_server_binary()), "-m", str(model or default_model_path()),
            "--parallel", str(parallel), "-c", str(ctx), "-t", str(threads),
            "--host", "127.0.0.1", "--port", str(port), "--slots", "--jinja", *peer_flags(),
            *extra_args]
    with log.open("ab") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    server = LlamaServer(f"http://127.0.0.1:{port}", port, process, log)
    if wait:
        try:
            server.wait_healthy()
        except BaseException:
            server.kill()
            raise
    return server
