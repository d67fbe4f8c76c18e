"""One reconcile at a time per ``PagedLLM``, and triggers folded into one already waiting.

Every handler (spec change, child event, pod event, periodic check) ends in the same
reconcile of the owner; kopf runs handlers concurrently, so without this two of them
could read the same status and write over each other. A reconcile reads everything
afresh once it holds its owner's turn, so an event trigger that finds another trigger
already waiting is redundant: the waiting one will see what this event reported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class OwnerGate:
    """Serialises actions per key; ``fold=True`` skips an action when one for the key is already waiting."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._waiting: dict[Hashable, int] = {}

    async def run(self, key: Hashable, action: Callable[[], Awaitable[T]], *, fold: bool = False) -> T | None:
        """``await action()`` once no other action of ``key`` runs; ``None`` if folded into a waiting one."""
        if fold and self._waiting.get(key, 0) > 0:
            return None
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._waiting[key] = self._waiting.get(key, 0) + 1
        entered = False
        try:
            async with lock:
                entered = True
                self._waiting[key] -= 1
                return await action()
        finally:
            if not entered:
                self._waiting[key] -= 1  # cancelled while waiting
            if self._waiting.get(key) == 0 and not lock.locked():
                # NOTE: forget idle keys, so deleted resources leave nothing behind.
                self._waiting.pop(key, None)
                self._locks.pop(key, None)

    def waiting(self, key: Hashable) -> int:
        """Actions of ``key`` waiting for their turn (not the running one)."""
        return self._waiting.get(key, 0)
