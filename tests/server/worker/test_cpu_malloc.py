"""The C heap's thresholds are raised once per process on Linux/glibc, and can be left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _in_a_fresh_process(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


CHECK = """
import resource
import torch
from pagedllm.server.worker.cpu_malloc import keep_freed_memory
print(keep_freed_memory())
def step():  # NOTE: a 64 MB tensor freed each step, as a layer's temporaries are
    x = torch.empty(16 << 20); x.fill_(1); small = torch.empty(1000); del x
for _ in range(20):  # NOTE: the heap settles within about ten steps (its layout varies run to run)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc only")
def test_freed_large_tensors_are_reused_without_new_page_faults():
    kept, faults = _in_a_fresh_process(CHECK, {"OMP_NUM_THREADS": "1"}).split()
    assert kept == "True"
    assert int(faults) < 1000  # NOTE: five times 64 MB of fresh 4 KB pages would be 81,920 faults


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc only")
def test_switched_off_glibc_hands_the_pages_back():
    kept, faults = _in_a_fresh_process(CHECK, {"OMP_NUM_THREADS": "1", "PAGEDLLM_CPU_MALLOC": "0"}).split()
    assert kept == "False"
    assert int(faults) > 5 * 16_000


def test_a_cpu_engine_keeps_freed_memory(monkeypatch, tiny_llama):
    from pagedllm.server import LLM

    calls = []
    monkeypatch.setattr("pagedllm.server.worker.model_runner.keep_freed_memory", lambda: calls.append(1))
    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, num_gpu_blocks_override=8, device="cpu")
    llm.shutdown()
    assert calls == [1]
