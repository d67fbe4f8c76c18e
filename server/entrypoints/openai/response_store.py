"""The responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, bounded."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.server.entrypoints.openai.protocol_responses import InputItem, ResponsesResponse


@dataclass(frozen=True)
class StoredResponse:
    response: ResponsesResponse
    conversation: list[InputItem]
    """Every item up to and including this response's output, as input items; not the instructions,
    which a follow-up request does not inherit."""


class ResponseStore:
    """The ``capacity`` most recently used responses by id; storing one more evicts the least recent.

    NOTE: per process: behind a load balancer a follow-up request must reach the same replica
    (session affinity), as with vLLM.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored
