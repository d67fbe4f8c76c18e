"""AsyncLLMEngine: the engine steps on its own thread; streams, aborts and failures reach the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
from api_factories import ENGINE_ARGS, engine_config

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.server.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class ThreadRecordingEngine(LLMEngine):
    """Records which threads call into the engine."""

    def __init__(self, config) -> None:
        self.callers: set[int] = set()
        super().__init__(config)

    def add_request(self, *args, **kwargs):
        self.callers.add(threading.get_ident())
        return super().add_request(*args, **kwargs)

    def abort_request(self, *args, **kwargs):
        self.callers.add(threading.get_ident())
        return super().abort_request(*args, **kwargs)

    def step(self):
        self.callers.add(threading.get_ident())
        return super().step()


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def started(config, **kwargs) -> AsyncLLMEngine:
    engine = AsyncLLMEngine(config, **kwargs)
    engine.start()
    await engine.wait_until_ready(timeout=60)
    return engine


async def idle_stats(engine: AsyncLLMEngine):
    for _ in range(500):
        stats = await engine.call(lambda e: e.stats())
        if (
            stats.num_running == 0
            and stats.blocks_used == 0
            and not await engine.call(lambda e: e.has_unfinished_requests())
        ):
            return stats
        await asyncio.sleep(0.01)
    return stats


def test_streams_are_cumulative_and_end_as_llm_generate(tiny_llama):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    expected = LLM(model=tiny_llama, **ENGINE_ARGS).generate(prompt, GREEDY)[0].outputs[0]

    async def main():
        engine = await started(engine_config(tiny_llama))
        try:
            outputs = [o async for o in engine.generate(prompt, GREEDY, "r1")]
        finally:
            await engine.shutdown()
        return outputs

    outputs = run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert outputs[-1].outputs[0].token_ids == expected.token_ids
    assert outputs[-1].outputs[0].text == expected.text


def test_only_the_engine_thread_touches_the_engine(tiny_llama):
    holder = {}

    def factory(config):
        holder["engine"] = ThreadRecordingEngine(config)
        return holder["engine"]

    async def main():
        engine = await started(engine_config(tiny_llama), engine_factory=factory)
        try:

            async def one(i):
                gen = engine.generate({"prompt_token_ids": [i + 1, 2, 3]}, GREEDY, f"r{i}")
                async for output in gen:
                    if i % 2 and len(output.outputs[0].token_ids) >= 2:
                        await gen.aclose()  # aborts
                        break

            await asyncio.gather(*(one(i) for i in range(8)))
            return await idle_stats(engine)
        finally:
            await engine.shutdown()

    stats = run(main())
    assert stats.num_running == 0 and stats.blocks_used == 0
    engine_thread = [t.ident for t in threading.enumerate() if t.name == "pagedllm-engine"]
    callers = holder["engine"].callers
    assert len(callers) == 1 and threading.get_ident() not in callers
    assert not engine_thread or callers == set(engine_thread)
    assert holder["engine"].is_closed, "the engine thread shuts the engine down on its way out"


def test_closing_or_cancelling_a_stream_aborts_and_frees_blocks(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)

    async def main():
        engine = await started(engine_config(tiny_llama))
        try:
            gen = engine.generate({"prompt_token_ids": list(range(1, 40))}, params, "closed")
            await gen.__anext__()
            await gen.aclose()
            assert engine.num_unfinished == 0

            streaming = asyncio.Event()
            long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

            async def consume():
                # NOTE: cancelled after its first token, with hundreds to go, so it cannot finish first
                async for _ in engine.generate({"prompt_token_ids": list(range(1, 40))}, long, "cancelled"):
                    streaming.set()

            task = asyncio.create_task(consume())
            await streaming.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await idle_stats(engine)
        finally:
            await engine.shutdown()

    stats = run(main())
    assert stats.num_running == stats.num_waiting == 0
    assert stats.blocks_used == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_invalid_requests_raise_value_error_at_add(tiny_llama):
    async def main():
        engine = await started(engine_config(tiny_llama))
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                await engine.add_request("long", {"prompt_token_ids": [1] * 500}, GREEDY)
            with pytest.raises(ValueError, match="already in use"):
                stream = await engine.add_request("dup", {"prompt_token_ids": [1, 2]}, GREEDY)
                await engine.add_request("dup", {"prompt_token_ids": [1, 2]}, GREEDY)
            async for _ in engine.iterate(stream):
                pass
            assert engine.num_unfinished == 0
        finally:
            await engine.shutdown()

    run(main())


def test_a_failing_step_kills_the_engine_and_fails_every_stream(tiny_llama):
    class Exploding(LLMEngine):
        steps = 0

        def step(self):
            Exploding.steps += 1
            if Exploding.steps > 3:
                raise RuntimeError("boom")
            return super().step()

    async def main():
        engine = await started(engine_config(tiny_llama), engine_factory=Exploding, warmup=False)
        try:
            gens = [engine.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, f"r{i}") for i in range(3)]
            results = await asyncio.gather(*(_drain(g) for g in gens), return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in results), results
            assert not engine.is_alive and not engine.is_ready
            with pytest.raises(EngineDeadError):
                await engine.add_request("late", {"prompt_token_ids": [1]}, GREEDY)
        finally:
            await engine.shutdown()

    run(main())


def test_a_load_failure_is_reported_to_waiters(tmp_path):
    async def main():
        engine = AsyncLLMEngine(engine_config(str(tmp_path / "missing")))
        engine.start()
        with pytest.raises(ValueError, match="not a model directory"):
            await engine.wait_until_ready(timeout=30)
        assert not engine.is_ready and engine.error is not None
        await engine.shutdown()

    run(main())


async def _drain(gen):
    async for _ in gen:
        pass
