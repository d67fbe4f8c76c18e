"""Running the operator only while this replica leads (:mod:`leader`).

standby   liveness answers (the kubelet must not restart a healthy standby); nothing is watched
leader    kopf runs; the Lease is renewed alongside
lost      kopf is stopped and the process exits non-zero: the pod restarts as a standby, so
          no reconcile of the old term can overlap the new leader's
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable

import aiohttp.web

from pagedllm.operator.leader import LeaderElector

LOST_LEADERSHIP = 3  # the process exit code when the Lease was lost
logger = logging.getLogger(__name__)


async def _standby_liveness(url: str | None) -> aiohttp.web.AppRunner | None:
    """Answer ``url`` (kopf's --liveness form, http://HOST:PORT/PATH) with 200 while on standby."""
    if not url:
        return None
    parts = urllib.parse.urlsplit(url)

    async def alive(_: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        return aiohttp.web.json_response({"standby": True})

    app = aiohttp.web.Application()
    app.router.add_get(parts.path or "/", alive)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, parts.hostname, parts.port or 80).start()
    return runner


async def run_elected(
    elector: LeaderElector, liveness: str | None, operate: Callable[[asyncio.Event], Awaitable[None]]
) -> int:
    """Wait for the Lease, then ``operate(stop)`` until it returns; ``stop`` is set if the Lease is lost.

    Returns the process exit code: 0 after a normal stop, :data:`LOST_LEADERSHIP` otherwise.
    """
    standby = await _standby_liveness(liveness)
    try:
        logger.info("waiting to lead (Lease %s)", "held by another replica or not yet taken")
        await elector.acquire()
    finally:
        if standby is not None:
            await standby.cleanup()  # NOTE: kopf serves the same liveness endpoint from now on
    logger.info("leading: reconciling from now on")
    stop = asyncio.Event()
    lost = asyncio.Event()

    async def keep() -> None:
        await elector.keep(time.monotonic)
        logger.error("the Lease could not be renewed in time: another replica may lead; stopping")
        lost.set()
        stop.set()

    keeper = asyncio.create_task(keep())
    try:
        await operate(stop)
    finally:
        keeper.cancel()
    if lost.is_set():
        return LOST_LEADERSHIP
    await elector.release()
    return 0
