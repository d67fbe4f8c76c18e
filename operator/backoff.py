"""Retry pacing: exponential delays with a cap, and a pacer for repairs that keep recurring.

Both take their clock or sleep as arguments, so tests drive them with a fake one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delays ``base``, ``base·factor``, ``base·factor²`` … never above ``cap`` (seconds)."""

    base: float = 1.0
    """Delay before the first retry."""
    cap: float = 300.0
    """The longest delay, however many attempts failed."""
    factor: float = 2.0
    """Growth from one delay to the next."""

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap or self.factor < 1:
            raise ValueError(
                f"Backoff(base={self.base}, cap={self.cap}, factor={self.factor}) is not allowed: "
                "need 0 < base <= cap and factor >= 1"
            )

    def delay(self, attempt: int) -> float:
        """The delay after ``attempt`` failures so far (0 for the first retry)."""
        # NOTE: the exponent is bounded so a long outage never overflows a float.
        return min(self.cap, self.base * self.factor ** min(max(attempt, 0), 64))

    async def retry(
        self,
        action: Callable[[], Awaitable[T]],
        *,
        attempts: int,
        retriable: Callable[[Exception], bool],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> T:
        """``action()`` until it succeeds, up to ``attempts`` times; sleeps :meth:`delay` between tries.

        An exception ``retriable`` refuses, or the last attempt's, is raised as is.
        """
        for attempt in range(attempts):
            try:
                return await action()
            except Exception as exc:
                if attempt + 1 >= attempts or not retriable(exc):
                    raise
            await sleep(self.delay(attempt))
        raise ValueError(f"attempts={attempts} is not allowed: must be >= 1")


class RepairPacer:
    """Spaces out repairs of an object that drifts again right after each one.

    A hand edit is reverted at once. If the same object keeps drifting (another
    controller or a webhook fighting over a field), each further repair waits
    :meth:`Backoff.delay` longer, so the two never hammer the API server; a check that
    finds the object as rendered resets its streak.
    """

    def __init__(self, backoff: Backoff, clock: Callable[[], float]):
        self._backoff = backoff
        self._clock = clock
        self._streaks: dict[Hashable, tuple[int, float]] = {}  # key -> (repairs in a row, not before)

    def due(self, key: Hashable) -> bool:
        """Whether a repair of ``key`` may run now."""
        streak = self._streaks.get(key)
        return streak is None or self._clock() >= streak[1]

    def repaired(self, key: Hashable) -> None:
        count = self._streaks.get(key, (0, 0.0))[0]
        self._streaks[key] = (count + 1, self._clock() + self._backoff.delay(count))

    def settled(self, key: Hashable) -> None:
        self._streaks.pop(key, None)
