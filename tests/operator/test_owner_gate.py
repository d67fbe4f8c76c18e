"""One reconcile at a time per owner, and event triggers folded into one already waiting."""

from __future__ import annotations

import asyncio

from pagedllm.operator.owner_gate import OwnerGate


async def _hold(log: list, key: str, release: asyncio.Event, result: str = "done") -> str:
    log.append(("start", key))
    await release.wait()
    log.append(("end", key))
    return result


def test_actions_of_one_owner_never_overlap_and_other_owners_run_meanwhile():
    async def scenario():
        gate, log, release = OwnerGate(), [], asyncio.Event()
        first = asyncio.create_task(gate.run("a", lambda: _hold(log, "a", release)))
        second = asyncio.create_task(gate.run("a", lambda: _hold(log, "a", release, "again")))
        other = asyncio.create_task(gate.run("b", lambda: _hold(log, "b", release)))
        await asyncio.sleep(0.01)
        assert log == [("start", "a"), ("start", "b")] and gate.waiting("a") == 1
        release.set()
        assert await asyncio.gather(first, second, other) == ["done", "again", "done"]
        a_log = [entry for entry in log if entry[1] == "a"]
        assert a_log == [("start", "a"), ("end", "a"), ("start", "a"), ("end", "a")]
        assert gate.waiting("a") == 0 and gate._locks == {}  # idle owners are forgotten

    asyncio.run(scenario())


def test_an_event_trigger_is_folded_into_one_already_waiting_but_never_a_spec_trigger():
    async def scenario():
        gate, log, release = OwnerGate(), [], asyncio.Event()
        running = asyncio.create_task(gate.run("a", lambda: _hold(log, "a", release)))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(gate.run("a", lambda: _hold(log, "a", release), fold=True))
        await asyncio.sleep(0)
        folded = await gate.run("a", lambda: _hold(log, "a", release), fold=True)
        assert folded is None and gate.waiting("a") == 1
        spec = asyncio.create_task(gate.run("a", lambda: _hold(log, "a", release, "spec")))
        await asyncio.sleep(0)
        assert gate.waiting("a") == 2
        release.set()
        assert await asyncio.gather(running, waiting, spec) == ["done", "done", "spec"]
        assert log.count(("start", "a")) == 3

    asyncio.run(scenario())


def test_a_trigger_cancelled_while_waiting_leaves_nothing_behind():
    async def scenario():
        gate, log, release = OwnerGate(), [], asyncio.Event()
        running = asyncio.create_task(gate.run("a", lambda: _hold(log, "a", release)))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(gate.run("a", lambda: _hold(log, "a", release)))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        assert gate.waiting("a") == 0
        release.set()
        await running
        assert gate._locks == {} and log == [("start", "a"), ("end", "a")]

    asyncio.run(scenario())
