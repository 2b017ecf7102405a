"""ggml's kernel switch for batch_invariant (backends/llamacpp/model.py), on the real model, each
case in a process of its own: the first model of a process fixes ggml's kernels for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.llamacpp.model import KERNEL_SWITCH

ROOT = Path(__file__).resolve().parents[1]

# Loads the model as told (argv[1]: batch_invariant), then prints: the tokens decoded, the switch
# as this process's environment and a child's see it after the load, and whether the prompt's last
# token gets the same logits (bytes) decoded alone (1 row) as with the 8 tokens before it (9 rows).
CASE = """
import ctypes, os, subprocess, sys
import llama_cpp as ll
from backends.llamacpp.model import KERNEL_SWITCH, LoadedModel

m = LoadedModel(None, n_ctx=256, n_batch=64, n_seq_max=1, threads=2, batch_invariant=sys.argv[1] == "1")
tokens = m.tokenize("The lighthouse stood on the rocky point for two hundred years.", special=False)[:9]

def last_logits(rows_before: int) -> bytes:
    ll.llama_memory_clear(m.memory, True)
    for start, end in ((0, rows_before), (rows_before, len(tokens))):
        if end == start:
            continue
        batch = ll.llama_batch_init(end - start, 0, 1)
        for i, t in enumerate(tokens[start:end]):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, start + i == len(tokens) - 1
        batch.n_tokens = end - start
        assert ll.llama_decode(m.ctx, batch) == 0
        ll.llama_batch_free(batch)
    return ctypes.string_at(ll.llama_get_logits_ith(m.ctx, -1), 4 * m.n_vocab)

child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({KERNEL_SWITCH!r}))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(len(tokens), os.environ.get(KERNEL_SWITCH), child, last_logits(len(tokens) - 1) == last_logits(0))
"""


@pytest.mark.parametrize(("invariant", "same_logits"), [(True, "True"), (False, "False")],
                         ids=["batch_invariant", "default kernels"])
def test_the_switch_holds_in_its_process_and_stays_out_of_the_ones_it_starts(invariant: bool,
                                                                            same_logits: str) -> None:
    """batch_invariant puts ggml's switch in the environment for the first matmul and takes it out
    after: this process keeps the tiled kernels (a token's logits are the same bytes decoded
    alone or with 8 rows), while a worker or llama-server it starts runs the kernels of its own
    settings. Without it a lone row takes ggml's vec_dot kernel and rounds otherwise."""
    env = {k: v for k, v in os.environ.items() if k != KERNEL_SWITCH}
    done = subprocess.run([sys.executable, "-c", CASE, "1" if invariant else "0"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["9", "None", "None", same_logits], done.stdout
