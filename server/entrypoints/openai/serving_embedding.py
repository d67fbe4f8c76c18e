"""``POST /v1/embeddings``: prompts in any of OpenAI's four shapes, pooled by the engine, as floats or base64.

Each input becomes one engine request with :class:`PoolingParams`: it is prefilled in the
same iterations as generation requests, pooled once its prompt is computed, and its KV
blocks are freed at once (nothing is decoded).
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from pagedllm.server.config import ConfigError
from pagedllm.server.entrypoints.openai.errors import bad_request, from_config_error
from pagedllm.server.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedllm.server.entrypoints.openai.serving import OpenAIServing, Prompt, RequestContext
from pagedllm.server.outputs import EmbeddingRequestOutput
from pagedllm.server.pooling_params import PoolingParams

INPUT_PARAMS = {"prompt": "input", "prompt_token_ids": "input"}
"""The engine's prompt fields are this endpoint's ``input``."""


class OpenAIServingEmbedding:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: EmbeddingRequest, context: RequestContext = RequestContext()) -> EmbeddingResponse:
        serving = self.serving
        started = time.monotonic()
        lora = serving.check_model(req.model)
        serving.check_ready()
        try:
            params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        except ConfigError as exc:
            raise from_config_error(exc) from exc
        prompts = serving.prompts(req.input, "input")
        self._check_no_empty_string(prompts)
        request_id = context.request_id or f"embd-{uuid.uuid4().hex}"
        cache_salt = serving.cache_salt(req.cache_salt, context)
        streams = await serving.start(request_id, prompts, params, INPUT_PARAMS, cache_salt, lora)
        outputs = await serving.finished(streams, EmbeddingRequestOutput)
        data = [
            EmbeddingData(index=i, embedding=encode(output.outputs.embedding, req.encoding_format))
            for i, output in enumerate(outputs)
        ]
        tokens = sum(len(p.token_ids) for p in prompts)
        serving.log_access(request_id, prompts, 0, started)
        return EmbeddingResponse(
            id=request_id,
            model=serving.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    @staticmethod
    def _check_no_empty_string(prompts: list[Prompt]) -> None:
        # NOTE: an empty string would still tokenize to the BOS token alone; OpenAI refuses it, and so do we.
        for i, prompt in enumerate(prompts):
            if prompt.text == "":
                shown = "input" if len(prompts) == 1 else f"input[{i}]"
                raise bad_request(f"{shown} is an empty string: give text to embed", "input")


def encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the numbers; ``base64``: their little-endian float32 bytes in base64, as OpenAI sends them."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
