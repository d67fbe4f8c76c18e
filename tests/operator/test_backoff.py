"""Retry pacing with a fake clock and sleep: exponential delays, a cap, and repairs spaced out."""

from __future__ import annotations

import asyncio
import logging

import kopf
import pytest

from pagedllm.operator.backoff import Backoff, RepairPacer
from pagedllm.operator.kube import ApiError
from pagedllm.operator.manifests import RenderConfig
from pagedllm.operator.reconcile import RETRY, Trigger, reconcile


def test_delays_double_up_to_the_cap():
    assert [Backoff(base=1, cap=30).delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert Backoff(base=10, cap=300).delay(10_000) == 300


@pytest.mark.parametrize("base, cap, factor", [(0, 1, 2), (5, 1, 2), (1, 5, 0.5)])
def test_nonsense_backoffs_are_refused(base, cap, factor):
    with pytest.raises(ValueError, match="not allowed"):
        Backoff(base=base, cap=cap, factor=factor)


class FakeSleep:
    def __init__(self):
        self.slept: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)


def failing(times: int, error: Exception):
    calls = []

    async def action():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return len(calls)

    return action, calls


def test_retry_sleeps_the_backoff_between_attempts():
    sleep = FakeSleep()
    action, calls = failing(3, ApiError(503, "busy"))
    result = asyncio.run(Backoff(base=1, cap=3).retry(action, attempts=5, retriable=lambda e: True, sleep=sleep))
    assert result == 4 and sleep.slept == [1, 2, 3]


def test_retry_gives_up_after_its_attempts_and_at_once_on_a_refusal():
    sleep = FakeSleep()
    action, calls = failing(10, ApiError(503, "busy"))
    with pytest.raises(ApiError):
        asyncio.run(Backoff(base=1, cap=60).retry(action, attempts=4, retriable=lambda e: True, sleep=sleep))
    assert len(calls) == 4 and sleep.slept == [1, 2, 4]

    sleep = FakeSleep()
    action, calls = failing(10, ApiError(403, "forbidden"))
    retriable = lambda e: isinstance(e, ApiError) and e.retriable  # noqa: E731
    with pytest.raises(ApiError, match="forbidden"):
        asyncio.run(Backoff(base=1, cap=60).retry(action, attempts=4, retriable=retriable, sleep=sleep))
    assert len(calls) == 1 and sleep.slept == []


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_repairs_of_an_object_that_keeps_drifting_are_spaced_out():
    clock = FakeClock()
    pacer = RepairPacer(Backoff(base=1, cap=4), clock)
    key = ("Deployment", "ns", "llama")
    waits = []
    for _ in range(5):
        assert pacer.due(key)
        pacer.repaired(key)
        start = clock.now
        while not pacer.due(key):
            clock.now += 0.5
        waits.append(clock.now - start)
    assert waits == [1, 2, 4, 4, 4]
    pacer.settled(key)
    pacer.repaired(key)
    clock.now += 1
    assert pacer.due(key), "a settled object starts over at the base delay"


CONFIG = RenderConfig(default_image="registry.example/pagedllm:test")
LOGGER = logging.getLogger("test")


class ServerError:
    """A client that reads the resource itself, and whose every other call fails with a 500."""

    def __init__(self, owner: dict):
        self.owner = owner

    async def get(self, kind, namespace, name, api_version=None):
        if kind == "PagedLLM":
            return self.owner
        raise ApiError(500, "etcd is unhappy")

    async def apply(self, manifest):
        raise ApiError(500, "etcd is unhappy")

    async def served(self, api_version, kind):
        raise ApiError(500, "etcd is unhappy")


def test_a_failing_reconcile_is_retried_later_and_later():
    body = {
        "apiVersion": "pagedllm.dev/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": "llama", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {"model": "meta-llama/Llama-2-7b-hf"},
    }
    delays = []
    for retry in range(7):
        with pytest.raises(kopf.TemporaryError) as caught:
            pacer = RepairPacer(RETRY, lambda: 0.0)
            trigger = Trigger(apply=True, retry=retry)
            asyncio.run(reconcile("ns", "llama", ServerError(body), CONFIG, pacer, LOGGER, trigger))  # type: ignore[arg-type]
        assert "etcd is unhappy" in str(caught.value)
        delays.append(caught.value.delay)
    assert delays == [10, 20, 40, 80, 160, 300, 300] == [RETRY.delay(n) for n in range(7)]
