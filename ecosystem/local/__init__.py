"""A fleet on this machine from real processes, for `fleet bench`, `scripts/demo` and the tests:
a private redis-server, `fleet worker` subprocesses, a llama-server on the real model, and the
bench and demo built on them. Nothing here assumes the repository layout: binaries come from
settings, PATH and the cache dir (backends/model.py `cache_dir()`)."""
