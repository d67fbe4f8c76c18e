"""The official ``openai`` client against a live server on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_factories import API_KEY, CHAT_TEMPLATE, ENGINE_ARGS, MODEL_NAME, live_server
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.server import LLM, SamplingParams

pytestmark = pytest.mark.timeout(120)
PROMPT = "The paged KV cache"


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server(tiny_llama) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The offline LLM on the same weights and engine arguments."""
    return LLM(model=tiny_llama, **ENGINE_ARGS)


def offline_text(reference, prompt, max_tokens, **params):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    return reference.generate(prompt, params)[0].outputs[0]


# -- completions ------------------------------------------------------------------------------
def test_completion_greedy_equals_llm_generate(client, reference):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = offline_text(reference, PROMPT, 12)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.object == "text_completion" and out.model == MODEL_NAME
    prompt_tokens = len(reference.get_tokenizer().encode(PROMPT))
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == prompt_tokens + len(expected.token_ids)


def test_completion_token_id_prompts_and_lists(client, reference):
    ids = reference.get_tokenizer().encode(PROMPT)
    out = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == offline_text(reference, {"prompt_token_ids": ids}, 5).text
    assert out.choices[1].text == offline_text(reference, {"prompt_token_ids": ids[:3]}, 5).text
    assert out.usage.prompt_tokens == len(ids) + 3
    out = client.completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=2, temperature=0)
    assert len(out.choices) == 2


def test_completion_streaming_matches_non_streaming(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_completion_n2_sampled(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    again = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    for index in (0, 1):
        streamed = "".join(ch.text for c in chunks for ch in c.choices if ch.index == index)
        assert streamed == out.choices[index].text


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # NOTE: byte tokens of partial characters all read "\ufffd", so keys may collide
        assert chosen <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) <= chosen + 1e-5  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    echo = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    assert echo.choices[0].text.startswith(PROMPT)
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert "".join(echo.choices[0].logprobs.tokens).startswith(PROMPT)
    assert len(echo.choices[0].logprobs.tokens) == echo.usage.prompt_tokens + 2


def test_stop_strings_streaming_and_not(client):
    greedy = (
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = greedy[10:13]
    cut = greedy.index(stop)
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == greedy[:cut] and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in chunks) == greedy[:cut]


# -- chat ------------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paging?"}]


def test_chat_greedy_equals_llm_generate_on_rendered_prompt(client, reference):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    rendered = reference.get_tokenizer().apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, chat_template=CHAT_TEMPLATE
    )
    ids = reference.get_tokenizer().encode(rendered, add_special_tokens=False)
    expected = offline_text(reference, {"prompt_token_ids": ids}, 10)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(expected.token_ids)


def test_chat_streaming_matches_non_streaming(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_n2_and_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.8,
        n=2,
        seed=1,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        assert all(t.bytes == list(t.token.encode()) for t in content)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0.8,
            n=2,
            seed=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    for choice in out.choices:
        streamed = "".join(ch.delta.content or "" for c in chunks for ch in c.choices if ch.index == choice.index)
        assert streamed == choice.message.content


# -- models, tokenizer, version, metrics --------------------------------------------------------------
def test_models_tokenize_detokenize_version(client, server, reference):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    ids = reference.get_tokenizer().encode(PROMPT)
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert tok["tokens"] == ids and tok["count"] == len(ids) and tok["max_model_len"] == 96
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > len(ids)
    assert httpx.get(f"{server.url}/version").json()["version"]


def metric_samples(url: str) -> dict:
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")))
            samples[key] = sample.value
            assert sample.labels.get("model_name") == MODEL_NAME, sample
    return samples


def test_metrics_parse_and_move(client, server):
    before = metric_samples(server.url)
    client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = metric_samples(server.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pagedllm:generation_tokens_total") == 5
    assert delta("pagedllm:prompt_tokens_total") > 0
    assert delta("pagedllm:request_success_total", finished_reason="length") == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"pagedllm:{name}_count") == 1
    assert delta("pagedllm:inter_token_latency_seconds_count") == 4
    assert delta("pagedllm:prefix_cache_queries_total") >= 1
    for gauge in (
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_swapped",
        "kv_cache_usage_perc",
        "cpu_kv_cache_usage_perc",
    ):
        assert (f"pagedllm:{gauge}", ()) in after
    assert ("pagedllm:num_preemptions_total", ()) in after
    assert ("pagedllm:prefix_cache_hits_total", ()) in after
    info = [k for k in after if k[0] == "pagedllm:cache_config_info"]
    assert info and dict(info[0][1])["block_size"] == str(ENGINE_ARGS["block_size"])
    assert dict(info[0][1])["num_gpu_blocks"] == "1024"
    assert dict(info[0][1])["cache_dtype"] == "auto"


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
