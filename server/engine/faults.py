"""Fault injection, for tests of the engine's fault isolation only.

Off unless ``PAGEDLLM_INJECT_FAULTS`` is set (never in production). Comma-separated rules:

    request=SUBSTR   output processing raises for requests whose id contains SUBSTR
    sampler=SUBSTR   the sampler raises while a request whose id contains SUBSTR is in its batch
    step=N           the Nth model step raises (1 and 2 are the warm-up's steps)
    step=N+          every model step from the Nth raises

    PAGEDLLM_INJECT_FAULTS='request=poison,step=40+' pagedllm serve
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedllm.server.config import ConfigError

FAULTS_ENV = "PAGEDLLM_INJECT_FAULTS"


class InjectedFault(RuntimeError):
    """Raised where a rule says so; nothing else raises it."""


@dataclass(frozen=True)
class FaultInjector:
    request: str | None = None
    sampler: str | None = None
    first_step: int | None = None
    every_step_after: bool = False

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        text = os.environ.get(FAULTS_ENV, "").strip()
        return cls.parse(text) if text else None

    @classmethod
    def parse(cls, text: str) -> FaultInjector:
        rules = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        unknown = sorted(set(rules) - {"request", "sampler", "step"})
        if unknown or not rules:
            raise ConfigError(FAULTS_ENV, text, "comma-separated request=SUBSTR, sampler=SUBSTR, step=N or step=N+")
        step = rules.get("step")
        return cls(
            rules.get("request"),
            rules.get("sampler"),
            int(step.rstrip("+")) if step else None,
            bool(step and step.endswith("+")),
        )

    def check_request(self, request_id: str) -> None:
        if self.request and self.request in request_id:
            raise InjectedFault(f"injected fault in output processing of {request_id}")

    def check_sampler(self, request_ids: Iterable[str]) -> None:
        if self.sampler and any(self.sampler in r for r in request_ids):
            raise InjectedFault("injected fault in the sampler")

    def check_step(self, step: int) -> None:
        if self.first_step is None:
            return
        if step == self.first_step or (self.every_step_after and step > self.first_step):
            raise InjectedFault(f"injected fault in model step {step}")


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
