"""Tests only: a sampler whose next requests write given tokens first, then what the model draws.

The served tiny models have random weights; to see what the server does with a model that
reasons, calls a tool or ends, a test scripts the tokens it writes. A scripted token replaces
the drawn one as is (no mask applies to it: the engine's grammar must still accept it), and once
a script runs out the model's own draws (masked by any grammar) follow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pagedllm.server.worker.sampler import Sampler
from pagedllm.server.worker.sampling_batch import Tokens


class Scripts:
    """Scripts for the requests the sampler sees next, one per request, in the order they arrive."""

    def __init__(self) -> None:
        self._waiting: list[list[int]] = []
        self._running: dict[str, list[int]] = {}

    def next_request_writes(self, token_ids: list[int]) -> None:
        self._waiting.append(list(token_ids))

    def rewrite(self, batch, out) -> None:
        for i in range(batch.num_sample_rows):
            request_id = batch.rows[i].request_id
            if request_id not in self._running and self._waiting:
                self._running[request_id] = self._waiting.pop(0)
            script = self._running.get(request_id)
            if script and out.rows[i] is not None:
                out.rows[i] = Tokens([script.pop(0)])


@contextlib.contextmanager
def scripted() -> Iterator[Scripts]:
    """Every :class:`Sampler` in this process follows the yielded scripts until the block ends."""
    scripts = Scripts()
    original = Sampler.__call__

    def call(sampler, logits, prompt_logits, batch):
        out = original(sampler, logits, prompt_logits, batch)
        scripts.rewrite(batch, out)
        return out

    Sampler.__call__ = call  # type: ignore[method-assign]
    try:
        yield scripts
    finally:
        Sampler.__call__ = original  # type: ignore[method-assign]
