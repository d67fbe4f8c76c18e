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

    def seconds(self) -> float:
        """The same clock as a monotonic one (the elector times expiry by it)."""
        return (self.now - T0).total_seconds()


def elector(kube, namespace: str, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(kube, LeaseConfig(namespace=namespace, identity=identity), clock, clock.seconds)


def client(cluster) -> KubeClient:
    return KubeClient(lambda: kubernetes.client.Configuration(host=cluster.url, api_key={"BearerToken": "Bearer t"}))


def lease(api: Client, namespace: str) -> dict:
    status, found = api.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/pagedllm-operator")
    assert status == 200, found
    return found["spec"]


def test_two_replicas_never_lead_at_once_and_the_second_takes_over_an_expired_lease(cluster):
    async def scenario():
        clock, kube_a, kube_b = Clock(), client(cluster), client(cluster)
        a = elector(kube_a, "leader-1", "operator-a", clock)
        b = elector(kube_b, "leader-1", "operator-b", clock)
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
        old = elector(kubes[0], "leader-2", "old", clock)
        assert await old.try_acquire_or_renew()
        racers = [elector(k, "leader-2", f"r{i}", clock) for i, k in enumerate(kubes[1:])]
        try:
            assert not any([await r.try_acquire_or_renew() for r in racers])  # first look: they start timing
            clock.advance(16)
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
        old = elector(kubes[0], "leader-4", "old", clock)
        assert await old.try_acquire_or_renew()
        fast = elector(kubes[1], "leader-4", "fast", clock)
        won_first = []

        async def fast_takes_it():
            won_first.append(await fast.try_acquire_or_renew())

        waiting = ReadThenWait(kubes[2], None)
        slow = elector(waiting, "leader-4", "slow", clock)
        try:
            assert not await fast.try_acquire_or_renew() and not await slow.try_acquire_or_renew()
            clock.advance(16)
            waiting.meanwhile = fast_takes_it
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
        other = LeaderElector(other_kube, LeaseConfig(namespace="leader-3", identity="b"), clock, clock.seconds)
        ticks = iter(range(100))
        elapsed = [0.0]

        async def sleep(seconds):
            elapsed[0] += seconds
            clock.advance(seconds)
            if next(ticks) == 2:  # meanwhile the lease was taken (a partition healed the other way)
                assert not await other.try_acquire_or_renew()  # b sees a's last renewal
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
        a = elector(kube_a, "leader-5", "a", clock)
        b = elector(kube_b, "leader-5", "b", clock)
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


class Skewed:
    """A wall clock ``offset`` seconds off the shared one (another machine's), for what an elector writes."""

    def __init__(self, clock: Clock, offset: float) -> None:
        self.clock, self.offset = clock, offset

    def __call__(self) -> datetime.datetime:
        return self.clock.now + datetime.timedelta(seconds=self.offset)


def test_clock_skew_never_makes_two_leaders(cluster):
    """The holder's clock runs an hour behind the candidate's: its renewTime looks an hour old, yet while it
    keeps renewing the candidate waits; once it stops, the candidate takes over after one lease duration."""

    async def scenario():
        clock, kube_a, kube_b = Clock(), client(cluster), client(cluster)
        config_a = LeaseConfig(namespace="leader-7", identity="behind")
        config_b = LeaseConfig(namespace="leader-7", identity="ahead")
        a = LeaderElector(kube_a, config_a, Skewed(clock, -3600), clock.seconds)
        b = LeaderElector(kube_b, config_b, Skewed(clock, +3600), clock.seconds)
        try:
            assert await a.try_acquire_or_renew()
            for _ in range(20):
                clock.advance(2)
                assert await a.try_acquire_or_renew() and not await b.try_acquire_or_renew()
            clock.advance(15)  # a stopped renewing: not yet one lease duration since b saw it change
            assert not await b.try_acquire_or_renew()
            clock.advance(1)
            assert await b.try_acquire_or_renew()
        finally:
            await kube_a.close()
            await kube_b.close()

    asyncio.run(scenario())


def test_a_new_candidate_waits_one_lease_duration_even_for_an_abandoned_lease(cluster):
    async def scenario():
        clock, kube_a, kube_b = Clock(), client(cluster), client(cluster)
        try:
            assert await elector(kube_a, "leader-8", "gone", clock).try_acquire_or_renew()
            clock.advance(3600)  # its holder died long ago, but b has only just looked
            b = elector(kube_b, "leader-8", "new", clock)
            assert not await b.try_acquire_or_renew()
            clock.advance(15)
            assert not await b.try_acquire_or_renew()
            clock.advance(1)
            assert await b.try_acquire_or_renew()
        finally:
            await kube_a.close()
            await kube_b.close()

    asyncio.run(scenario())
