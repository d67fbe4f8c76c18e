"""Every error case: its status code and OpenAI's error shape ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import pytest
from api_factories import API_KEY, CHAT_TEMPLATE, MODEL_NAME, live_server, sse_events

from pagedllm.server.entrypoints.openai.api_server import ServerSettings

pytestmark = pytest.mark.timeout(120)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server(tiny_llama) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def assert_error(response: httpx.Response, status: int, *, param=None, contains=()) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error
    return error


def complete(http, **body):
    return http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, **body})


def chat(http, **body):
    messages = body.pop("messages", [{"role": "user", "content": "hi"}])
    return http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 4, **body})


# -- 400: invalid parameters name the field and the value ---------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 2.0),
        ("top_p", 0.0),
        ("n", 0),
        ("max_tokens", -3),
        ("max_tokens", 0),
        ("presence_penalty", 5.0),
        ("frequency_penalty", -9.0),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("top_k", -5),
        ("logprobs", 50),
        ("logprobs", -1),
        ("min_tokens", 99),
    ],
)
def test_completion_invalid_value_is_400_naming_field_and_value(http, field, value):
    assert_error(complete(http, **{field: value}), 400, param=field, contains=(field, str(value)))


@pytest.mark.parametrize(
    "body, param, text",
    [
        ({"best_of": 1, "n": 2}, "best_of", "best_of=1"),
        ({"n": 500}, "n", "max_num_seqs"),
        ({"n": 2, "best_of": 3, "stream": True}, "best_of", "streaming"),
        ({"stop_token_ids": [999999]}, "stop_token_ids", "999999"),
        ({"stop": [""]}, "stop", "stop"),
        ({"seed": 1 << 70}, "seed", str(1 << 70)),
        ({"temperature": "hot"}, "temperature", "hot"),
        ({"logit_bias": {"x": 5}}, "logit_bias", "logit_bias"),
        ({"logit_bias": {"1": 500}}, "logit_bias", "logit_bias"),
        ({"logit_bias": {"999999": 5}}, "logit_bias", "999999"),
        ({"guided_choice": []}, "guided_choice", "guided_choice"),
        ({"guided_regex": "(", "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json", "cannot be compiled"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema is required"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"suffix": "x"}, "suffix", "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"use_beam_search": True, "temperature": 1.0}, "temperature", "beam"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": ""}, None, "empty"),
        ({"prompt": [1, 2, 100000]}, "prompt", "100000"),
        ({"prompt": [[1, 2], [-1]]}, "prompt", "-1"),
        ({"prompt": None}, "prompt", "prompt"),
    ],
)
def test_completion_bad_request(http, body, param, text):
    assert_error(complete(http, **body), 400, param=param, contains=(text,))


def test_prompt_longer_than_max_model_len_is_400(http):
    error = assert_error(complete(http, prompt="x" * 200), 400, contains=("max_model_len",))
    assert "200" in error["message"]
    error = assert_error(
        complete(http, prompt="x" * 90, max_tokens=20),
        400,
        param="max_tokens",
        contains=("maximum context length is 96", "110"),
    )
    assert_error(chat(http, messages=[{"role": "user", "content": "y" * 200}]), 400, contains=("max_model_len",))


def test_missing_and_malformed_bodies_are_400(http):
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400, param="prompt", contains=("required",))
    response = http.post("/v1/completions", content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"})
    assert_error(response, 400, contains=("JSON",))
    assert_error(http.post("/v1/completions", json=["not", "an", "object"]), 400)
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME}), 400, param="messages")
    assert_error(http.post("/tokenize", json={"tokens": "x"}), 400)


def test_chat_bad_requests(http):
    assert_error(chat(http, top_logprobs=2), 400, param="top_logprobs")
    assert_error(chat(http, logprobs=True, top_logprobs=99), 400, param="top_logprobs", contains=("top_logprobs=99",))
    assert_error(chat(http, messages=[]), 400, param="messages")
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(chat(http, messages=parts), 400, param="messages", contains=("image_url",))
    response = chat(http, response_format={"type": "json_object"}, max_tokens=8)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"].startswith("{")
    assert_error(chat(http, tools=[{"type": "function"}]), 400, param="tools")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert_error(
        chat(http, tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        param="tool_choice",
        contains=("'g'",),
    )
    assert_error(chat(http, max_completion_tokens=0), 400, param="max_tokens")


def test_chat_without_template_is_a_clear_400(http, server):
    server.serving.chat_template = None  # the tiny byte tokenizer ships no template
    try:
        error = assert_error(chat(http), 400, param="messages", contains=("chat template", "--chat-template"))
        assert "/v1/completions" in error["message"]
        assert_error(http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}), 400)
    finally:
        server.serving.chat_template = CHAT_TEMPLATE


def test_tokenizer_endpoints_bad_requests(http):
    assert_error(http.post("/tokenize", json={}), 400, param="prompt")
    assert_error(http.post("/detokenize", json={"tokens": [-5]}), 400, param="tokens", contains=("-5",))
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, param="tokens")


# -- 401, 404, 405 ------------------------------------------------------------------------------------------
def test_missing_or_wrong_api_key_is_401(server):
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": f"Basic {API_KEY}"},
    ):
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        error = assert_error(response, 401, contains=("API key",))
        assert error["code"] == "invalid_api_key"
        assert_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401)
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path


def test_unknown_model_is_404(http):
    error = assert_error(complete(http, model="gpt-9"), 404, param="model", contains=("gpt-9",))
    assert error["code"] == "model_not_found"
    assert_error(chat(http, model="gpt-9"), 404, param="model")
    assert_error(http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404)


def test_unknown_route_and_method_in_openai_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


# -- 503: draining, queue full --------------------------------------------------------------------------------
def test_draining_returns_503_with_retry_after(http, server):
    server.serving.draining = True
    try:
        response = complete(http)
        assert_error(response, 503, contains=("shutting down",))
        assert int(response.headers["Retry-After"]) >= 1
        assert_error(chat(http), 503)
        assert_error(http.get("/ready"), 503)
        assert http.get("/health").status_code == 200
    finally:
        server.serving.draining = False
    assert complete(http).status_code == 200


def test_full_waiting_queue_returns_503_with_retry_after(tiny_llama):
    settings = ServerSettings(served_model_names=[MODEL_NAME], max_queue_len=2)
    with (
        live_server(tiny_llama, settings, max_num_seqs=1) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        long = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 90, "ignore_eos": True, "stream": True}
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(http.stream("POST", "/v1/completions", json=long))
            events = sse_events(first.iter_lines())
            next(events)  # running: it holds the only sequence slot
            results = []
            waiters = [threading.Thread(target=lambda: results.append(complete(http, max_tokens=2))) for _ in range(2)]
            for t in waiters:
                t.start()
            _wait_for(lambda: server.engine.num_unscheduled == 2)
            response = complete(http)
            error = assert_error(response, 503, contains=("max-waiting-requests=2",))
            assert error["type"] == "service_unavailable" and response.headers["Retry-After"]
            metrics = http.get("/metrics").text
            assert f'pagedllm:requests_rejected_total{{model_name="{MODEL_NAME}",reason="queue_full"}} 1.0' in metrics
            assert http.get("/ready").status_code == 200  # overloaded is not unhealthy
            chunks = [json.loads(e) for e in events if e != "[DONE]"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        for t in waiters:
            t.join(timeout=60)
        assert [r.status_code for r in results] == [200, 200]


def _wait_for(predicate, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
