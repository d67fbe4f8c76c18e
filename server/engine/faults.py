"""What the engine does when steps fail: one failed step fails its requests; too many are fatal.

NOTE: tests inject faults through test doubles of the workers (``ParallelConfig.worker_cls``),
never through checks here or on the step path.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class EngineFatalError(RuntimeError):
    """The engine's state can no longer be trusted (broken invariants, repeated step failures): it must stop."""


class StepFailureWindow:
    """Counts failed model steps; too many within ``window_s`` seconds is fatal.

    One failed step fails only the requests in it. A model that keeps failing, though,
    would fail every request sent to it, so after ``max_failures`` failures within the
    window the engine gives up and the pod is restarted instead.
    """

    def __init__(self, max_failures: int = 3, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.max_failures = max_failures
        self.window_s = window_s
        self.clock = clock
        self._times: deque[float] = deque()

    def record(self, error: BaseException) -> None:
        """Note a failed step; raise :class:`EngineFatalError` if it is one too many."""
        now = self.clock()
        self._times.append(now)
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_failures:
            raise EngineFatalError(
                f"{len(self._times)} model steps failed within {self.window_s:.0f}s; the last with {error!r}"
            )
