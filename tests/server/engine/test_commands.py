"""A command's failure always reaches the request awaiting it, whatever the exception."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from pagedllm.server.engine.commands import CallEngine, execute


def _fails_with(exc: BaseException):
    def fn(engine):
        raise exc

    return fn


@pytest.mark.parametrize("exc", [StopIteration(), StopAsyncIteration(), ValueError("bad")])
def test_an_awaited_command_fails_instead_of_hanging(exc):
    done: concurrent.futures.Future = concurrent.futures.Future()
    execute(None, CallEngine(_fails_with(exc), done))  # type: ignore[arg-type]

    async def wait():
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout=5)

    with pytest.raises(Exception) as raised:
        asyncio.run(wait())
    assert not isinstance(raised.value, asyncio.TimeoutError)
    if isinstance(exc, ValueError):
        assert raised.value is exc
    else:
        assert isinstance(raised.value, RuntimeError) and raised.value.__cause__ is exc
