"""What every endpoint shares: engine request ids apart from the client's ``X-Request-Id``, and usage
with the prompt tokens the prefix cache served."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import openai
import pytest
from api_factories import API_KEY, ENGINE_ARGS, MODEL_NAME, live_server, wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(180)
BLOCK_SIZE = ENGINE_ARGS["block_size"]
FILLER = " of the paged KV cache, in shared blocks."


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server(tiny_llama) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


# -- X-Request-Id --------------------------------------------------------------------------------------
@contextlib.contextmanager
def engine_held(server):
    """The engine thread waits between two steps until the block ends (requests queue up meanwhile)."""
    gate = threading.Event()
    server.engine.submit(lambda engine: gate.wait(60))
    try:
        yield
    finally:
        gate.set()


def in_threads(*fns) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn, daemon=True) for fn in fns]
    for thread in threads:
        thread.start()
    return threads


def test_two_streams_with_the_same_request_id_both_complete(server, client):
    args = dict(model=MODEL_NAME, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    expected = {p: client.completions.create(prompt=p, **args).choices[0].text for p in ("one", "two")}
    chunks: dict[str, list] = {}

    def stream(prompt: str) -> None:
        response = client.completions.create(
            prompt=prompt, stream=True, extra_headers={"X-Request-Id": "retry-1"}, **args
        )
        chunks[prompt] = list(response)

    with engine_held(server):
        threads = in_threads(lambda: stream("one"), lambda: stream("two"))
        wait_for(lambda: server.engine.num_unfinished == 2)  # NOTE: both in the engine at once, one X-Request-Id
    for thread in threads:
        thread.join(60)
    for prompt, got in chunks.items():
        assert {c.id for c in got} == {"retry-1"}
        assert "".join(c.choices[0].text for c in got) == expected[prompt]
        assert got[-1].choices[0].finish_reason == "length"
    assert sorted(chunks) == ["one", "two"]
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={"X-Request-Id": "retry-1"},
    )
    assert whole.id == "retry-1"


def test_a_disconnect_aborts_its_own_request_not_the_other_with_the_same_id(server):
    body = {
        "model": MODEL_NAME,
        "prompt": "go",
        "max_tokens": 80,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "shared"}
    aborted = counter(server.url, "pagedllm:request_success_total", finished_reason="abort")
    staying: list[str] = []
    first_chunk, leave = threading.Event(), threading.Event()

    def stay(http: httpx.Client) -> None:
        with http.stream("POST", "/v1/completions", json=body) as response:
            staying.extend(line for line in response.iter_lines() if line.startswith("data: "))

    def go_away(http: httpx.Client) -> None:
        with http.stream("POST", "/v1/completions", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
            first_chunk.set()
            leave.wait(60)  # NOTE: leaving the block closes the connection

    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        with engine_held(server):
            threads = in_threads(lambda: stay(http), lambda: go_away(http))
            wait_for(lambda: server.engine.num_unfinished == 2)
        assert first_chunk.wait(60)
        with engine_held(server):
            leave.set()
            wait_for(lambda: server.engine.num_unfinished == 1)  # one aborted, before either could finish
        for thread in threads:
            thread.join(60)
    assert staying[-1] == "data: [DONE]"
    *chunks, usage = [json.loads(line.removeprefix("data: ")) for line in staying[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 80
    assert counter(server.url, "pagedllm:request_success_total", finished_reason="abort") == aborted + 1
    stats = wait_until_idle(server)
    assert stats.blocks_used == 0 and server.engine.num_unfinished == 0


# -- cached prompt tokens ------------------------------------------------------------------------------
def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def completion_usage(client, prompt: str, stream: bool):
    args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0)
    if not stream:
        return client.completions.create(**args).usage
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    return chunks[-1].usage


def chat_usage(client, prompt: str, stream: bool):
    args = dict(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=3, temperature=0)
    if not stream:
        return client.chat.completions.create(**args).usage
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    return chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", [completion_usage, chat_usage], ids=["completions", "chat"])
def test_a_repeated_prompt_reports_the_tokens_the_prefix_cache_served(client, endpoint, stream):
    prompt = f"{stream} {endpoint.__name__}{FILLER}"  # NOTE: differs from the others in its first block
    first = endpoint(client, prompt, stream)
    assert cached(first) == 0
    again = endpoint(client, prompt, stream)
    assert again.prompt_tokens == first.prompt_tokens
    # NOTE: whole blocks only, and never the prompt's last token, which must be computed for its logits
    assert cached(again) == (first.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_cached_tokens_count_each_prompt_of_a_batch(client):
    prompts = [f"batch {i}{FILLER}" for i in range(2)]
    first = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=2)
    again = client.completions.create(model=MODEL_NAME, prompt=prompts + ["new"], max_tokens=2)
    per_prompt = [(first.usage.prompt_tokens // 2 - 1) // BLOCK_SIZE * BLOCK_SIZE] * 2
    assert cached(first.usage) == 0 and cached(again.usage) == sum(per_prompt)


def test_without_prefix_caching_nothing_is_reported_cached(tiny_llama):
    with live_server(tiny_llama, enable_prefix_caching=False) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
            prompt = f"uncached{FILLER}"
            for _ in range(2):
                assert cached(completion_usage(client, prompt, stream=False)) == 0
                assert cached(chat_usage(client, prompt, stream=True)) == 0
