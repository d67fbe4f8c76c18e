"""Per-request pooling parameters: how a prompt's hidden states become one embedding (vLLM's ``PoolingParams``).

A pooling request runs its prompt through the model like any prefill (its K/V are
written into blocks, so a long prompt is chunked and batched with generation), never
decodes, and ends with the pooled final hidden state; its blocks are freed at once::

    hidden states after the final norm   h0 h1 h2 ... h(n-1)
    last:  h(n-1)            mean:  (h0 + ... + h(n-1)) / n      then  x / ||x||2  if normalize
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.server.config import POOLING_TYPES, ConfigError


@dataclass(frozen=True)
class PoolingParams:
    """How to pool one request. Invalid values raise :class:`ConfigError` naming field and value."""

    pooling_type: str | None = None
    """``last`` or ``mean``; None: the engine's (``--pooling-type``, else the model's sentence-transformers
    pooling config, else ``last``)."""
    normalize: bool = True
    """Scale the embedding to unit L2 norm (vLLM's default for embeddings)."""
    dimensions: int | None = None
    """Matryoshka truncation to this many dimensions. The engine refuses any value for a model not
    trained for it (every model served here), as vLLM and OpenAI do."""

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError("pooling_type", self.pooling_type, f"choose one of {list(POOLING_TYPES)}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ConfigError("dimensions", self.dimensions, "must be an integer >= 1", problem="is invalid")

    @property
    def reads_every_position(self) -> bool:
        """Whether every prompt position's hidden state is needed (so no prompt block may come from the cache)."""
        return self.pooling_type == "mean"
