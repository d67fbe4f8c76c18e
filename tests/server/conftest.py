"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch
from engine_factories import TINY_SHAPES

from pagedllm.server.config import EngineConfig
from pagedllm.server.demo import save_tiny_llama


@pytest.fixture(autouse=True)
def engine_tests_on_cuda(monkeypatch):
    """On a machine with a GPU, the engine tests run there, against the same float32 oracle.

    An engine whose device is left to ``auto`` gets CUDA, in float32 unless the test asks
    for a dtype (``auto`` would pick bfloat16 for a float32 checkpoint on CUDA, and the
    tests compare with ``transformers`` in float32). What only a CPU runs stays on the
    CPU: the numba attention backend, and more tensor-parallel ranks than visible GPUs.
    Without a GPU this does nothing.
    """
    if not torch.cuda.is_available():
        return
    build = EngineConfig.from_kwargs.__func__

    def from_kwargs(cls, **kwargs):
        if kwargs.get("device", "auto") == "auto":
            ranks = kwargs.get("tensor_parallel_size", 1)
            cpu_only = kwargs.get("attention_backend") == "numba" or ranks > torch.cuda.device_count()
            kwargs["device"] = "cpu" if cpu_only else "cuda"
        if kwargs["device"] == "cuda" and kwargs.get("dtype", "auto") == "auto":
            kwargs["dtype"] = "float32"
        return build(cls, **kwargs)

    monkeypatch.setattr(EngineConfig, "from_kwargs", classmethod(from_kwargs))


@pytest.fixture(scope="session")
def tiny_llama_dirs(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a saved random LLaMA (float32, byte tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-llama")
    return {
        name: save_tiny_llama(str(root / name), seed=i, **overrides)
        for i, (name, overrides) in enumerate(TINY_SHAPES.items())
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dirs) -> str:
    return tiny_llama_dirs["gqa"]
