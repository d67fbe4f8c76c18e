"""PagedLLM engine, models, sampler, HTTP API and CLI.

``from pagedllm.server import LLM, SamplingParams`` is the offline API. The names are
loaded on first use, so light users of this package (the operator reads only the CLI
flag definitions) do not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "pagedllm.server.llm",
    "SamplingParams": "pagedllm.server.sampling_params",
    "RequestOutputKind": "pagedllm.server.sampling_params",
    "PoolingParams": "pagedllm.server.pooling_params",
    "LoRARequest": "pagedllm.server.lora_request",
    "RequestOutput": "pagedllm.server.outputs",
    "CompletionOutput": "pagedllm.server.outputs",
    "EmbeddingRequestOutput": "pagedllm.server.outputs",
    "EmbeddingOutput": "pagedllm.server.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedllm.server' has no attribute {name!r}")
