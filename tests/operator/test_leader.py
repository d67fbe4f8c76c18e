"""Leader election on a Lease, against the emulated API server: one leader at a time, take-over on expiry."""

from __future__ import annotations

import asyncio
import datetime

import kubernetes
import pytest
from k8s_emulator import Client

from pagedllm.operator.kube import KubeClient
from pagedllm.operator.leader import LeaderElector, LeaseConfig

pytestmark = pytest.mark.k8s

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)


def client(cluster) -> KubeClient:
    return KubeClient(lambda: kubernetes.client.Configuration(host=cluster.url, api_key={"BearerToken": "Bearer t"}))


def lease(api: Client, namespace: str) -> dict:
    status, found = api.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/pagedllm-operator")
    assert status == 200, found
    return found["spec"]


def test_two_replicas_never_lead_at_once_and_the_second_takes_over_an_expired_lease(cluster):
    async def scenario():
        clock, kube_a, kube_b = Clock(), client(cluster), client(cluster)
        a = LeaderElector(kube_a, LeaseConfig(namespace="leader-1", identity="operator-a"), clock)
        b = LeaderElector(kube_b, LeaseConfig(namespace="leader-1", identity="operator-b"), clock)
        try:
            assert await a.try_acquire_or_renew()
            assert not await b.try_acquire_or_renew()
            spec = lease(Client(cluster.url), "leader-1")
            assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == (
                "operator-a",
                15,
                0,
            )
            for _ in range(10):  # a renews every 2 s: b never gets it
                clock.advance(2)
                assert await a.try_acquire_or_renew() and not await b.try_acquire_or_renew()
            clock.advance(14)  # a stopped renewing, but its lease still runs
            assert not await b.try_acquire_or_renew()
            clock.advance(2)
            assert await b.try_acquire_or_renew()
            spec = lease(Client(cluster.url), "leader-1")
            assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("operator-b", 1)
            assert not await a.try_acquire_or_renew()  # a comes back: b holds it now
        finally:
            await kube_a.close()
            await kube_b.close()

    asyncio.run(scenario())


def test_of_two_candidates_racing_for_an_expired_lease_one_wins(cluster):
    async def scenario():
        clock, kubes = Clock(), [client(cluster) for _ in range(3)]
        old = LeaderElector(kubes[0], LeaseConfig(namespace="leader-2", identity="old"), clock)
        assert await old.try_acquire_or_renew()
        clock.advance(60)
        racers = [
            LeaderElector(k, LeaseConfig(namespace="leader-2", identity=f"r{i}"), clock)
            for i, k in enumerate(kubes[1:])
        ]
        try:
            won = await asyncio.gather(*(r.try_acquire_or_renew() for r in racers))
            assert sorted(won) == [False, True]
            holder = lease(Client(cluster.url), "leader-2")["holderIdentity"]
            assert holder == f"r{won.index(True)}"
        finally:
            for kube in kubes:
                await kube.close()

    asyncio.run(scenario())


class ReadThenWait:
    """The API client of a candidate that, between reading the Lease and writing it, lets ``meanwhile`` run."""

    def __init__(self, kube: KubeClient, meanwhile):
        self.kube, self.meanwhile = kube, meanwhile

    async def request(self, method, path, **kwargs):
        answer = await self.kube.request(method, path, **kwargs)
        if method == "GET" and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            await meanwhile()
        return answer


def test_a_write_from_a_stale_read_loses_to_the_one_that_came_first(cluster):
    async def scenario():
        clock, kubes = Clock(), [client(cluster) for _ in range(3)]
        old = LeaderElector(kubes[0], LeaseConfig(namespace="leader-4", identity="old"), clock)
        assert await old.try_acquire_or_renew()
        clock.advance(60)
        fast = LeaderElector(kubes[1], LeaseConfig(namespace="leader-4", identity="fast"), clock)
        won_first = []

        async def fast_takes_it():
            won_first.append(await fast.try_acquire_or_renew())

        slow = LeaderElector(
            ReadThenWait(kubes[2], fast_takes_it), LeaseConfig(namespace="leader-4", identity="slow"), clock
        )
        try:
            assert not await slow.try_acquire_or_renew()  # it read an expired lease, but fast wrote first: 409
            assert won_first == [True] and lease(Client(cluster.url), "leader-4")["holderIdentity"] == "fast"
        finally:
            for kube in kubes:
                await kube.close()

    asyncio.run(scenario())


def test_a_leader_that_cannot_renew_gives_up_within_the_renew_deadline(cluster):
    async def scenario():
        clock, kube = Clock(), client(cluster)
        config = LeaseConfig(namespace="leader-3", identity="a")
        elector = LeaderElector(kube, config, clock)
        await elector.acquire()
        other_kube = client(cluster)
        other = LeaderElector(other_kube, LeaseConfig(namespace="leader-3", identity="b"), clock)
        ticks = iter(range(100))
        elapsed = [0.0]

        async def sleep(seconds):
            elapsed[0] += seconds
            clock.advance(seconds)
            if next(ticks) == 2:  # meanwhile the lease was taken (a partition healed the other way)
                clock.advance(20)
                assert await other.try_acquire_or_renew()

        try:
            await elector.keep(lambda: elapsed[0], sleep)
            assert config.renew_deadline <= elapsed[0] <= config.renew_deadline + 3 * config.retry_period
        finally:
            await kube.close()
            await other_kube.close()

    asyncio.run(scenario())


def test_a_leader_stopping_on_purpose_hands_over_at_once(cluster):
    async def scenario():
        clock, kube_a, kube_b = Clock(), client(cluster), client(cluster)
        a = LeaderElector(kube_a, LeaseConfig(namespace="leader-5", identity="a"), clock)
        b = LeaderElector(kube_b, LeaseConfig(namespace="leader-5", identity="b"), clock)
        try:
            assert await a.try_acquire_or_renew() and not await b.try_acquire_or_renew()
            await b.release()  # not the holder: nothing changes
            assert lease(Client(cluster.url), "leader-5")["holderIdentity"] == "a"
            await a.release()
            assert lease(Client(cluster.url), "leader-5")["holderIdentity"] == ""
            assert await b.try_acquire_or_renew()  # no wait for the 15 s lease to run out
            spec = lease(Client(cluster.url), "leader-5")
            assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == ("b", 15, 1)
        finally:
            await kube_a.close()
            await kube_b.close()

    asyncio.run(scenario())


def test_lease_timings_must_leave_the_old_leader_time_to_stop():
    with pytest.raises(ValueError, match="retry < renew_deadline < duration"):
        LeaseConfig(namespace="x", identity="y", lease_duration=10, renew_deadline=10)
