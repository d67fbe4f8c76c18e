"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
from engine_factories import TINY_SHAPES

from pagedllm.server.demo import save_tiny_llama


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
