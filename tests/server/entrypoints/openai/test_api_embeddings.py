"""``POST /v1/embeddings`` with the official ``openai`` client: embeddings equal transformers' final hidden
states (floats and base64), errors are 400s in OpenAI's shape, embeddings and generation share the engine,
and every block is free afterwards."""

from __future__ import annotations

import base64
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from api_factories import API_KEY, MODEL_NAME, live_server, wait_until_idle
from engine_factories import HFReference, make_prompts, write_sentence_transformers_pooling
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(180)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ATOL = 1e-5
# NOTE: up to 70 tokens with the byte tokenizer (and its BOS): several 16-token blocks, and chunked by the
# 32-token step budget below; the server's max_model_len is 96.
TEXTS = ["The paged KV cache", "blocks", "Attention reads the cache through block tables, " * 2]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server(tiny_llama, max_num_batched_tokens=32, max_num_seqs=16) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_llama) -> HFReference:
    return HFReference(tiny_llama)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.tokenizer


def assert_close(got, expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), expected, atol=ATOL, rtol=0)


def test_float_embeddings_equal_transformers_last_token(client, hf, tokenizer, server):
    out = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float", user="someone")
    assert out.object == "list" and out.model == MODEL_NAME
    assert [d.index for d in out.data] == [0, 1, 2] and all(d.object == "embedding" for d in out.data)
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert max(map(len, ids)) > 32  # the longest prompt is prefilled in chunks
    for data, tokens in zip(out.data, ids):
        assert len(data.embedding) == 64
        assert_close(data.embedding, hf.embedding(tokens, "last"))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    assert wait_until_idle(server).num_free_gpu_blocks == 1024


def test_base64_embeddings_are_little_endian_float32(client, http, hf, tokenizer):
    out = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2], encoding_format="base64")
    for data, text in zip(out.data, TEXTS[:2]):
        assert isinstance(data.embedding, str)
        decoded = np.frombuffer(base64.b64decode(data.embedding), dtype="<f4")
        assert_close(decoded.tolist(), hf.embedding(tokenizer.encode(text), "last"))
    # the client's default asks for base64 and decodes it itself
    default = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])
    assert_close(default.data[0].embedding, hf.embedding(tokenizer.encode(TEXTS[0]), "last"))
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0]}).json()  # float when the body leaves it out
    assert raw["data"][0]["embedding"] == pytest.approx(default.data[0].embedding, abs=1e-7)
    assert set(raw["usage"]) == {"prompt_tokens", "total_tokens"}


def test_token_id_inputs_and_unnormalised_embeddings(client, hf):
    prompts = [make_prompts(1, min_len=n, max_len=n, seed=n)[0] for n in (1, 17, 90)]
    one = client.embeddings.create(model=MODEL_NAME, input=prompts[1], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == 17
    assert_close(one.data[0].embedding, hf.embedding(prompts[1], "last"))
    many = client.embeddings.create(model=MODEL_NAME, input=prompts, encoding_format="float")
    for data, prompt in zip(many.data, prompts):
        assert_close(data.embedding, hf.embedding(prompt, "last"))
    raw = client.embeddings.create(
        model=MODEL_NAME, input=prompts[2], encoding_format="float", extra_body={"normalize": False}
    )
    assert_close(raw.data[0].embedding, hf.embedding(prompts[2], "last", normalize=False))


def assert_error(response: httpx.Response, status: int, param: str, *contains: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    for text in contains:
        assert text in error["message"], error


@pytest.mark.parametrize(
    "body, param, contains",
    [
        ({"input": ""}, "input", ["empty string"]),
        ({"input": ["a", ""]}, "input", ["input[1] is an empty string"]),
        ({"input": []}, "input", ["input is empty"]),
        ({"input": [[]]}, "input", ["input", "empty"]),
        ({"input": [[1, 2, 999999]]}, "input", ["999999"]),
        ({"input": list(range(97))}, "input", ["97 tokens", "max_model_len=96", "at most 96 tokens"]),
        ({"input": "x", "dimensions": 32}, "dimensions", ["dimensions=32", "matryoshka"]),
        ({"input": "x", "dimensions": 0}, "dimensions", ["dimensions=0"]),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", ["'hex'"]),
        ({"input": 3.5}, "input", []),
        ({}, "input", ["input is required"]),
    ],
)
def test_invalid_requests_are_400_in_openai_shape(http, server, body, param, contains):
    assert_error(http.post("/v1/embeddings", json=body), 400, param, *contains)
    assert wait_until_idle(server).num_free_gpu_blocks == 1024  # a refused batch leaves nothing behind


def test_the_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=16)
    assert info.value.status_code == 400 and info.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_a_prompt_filling_max_model_len_is_embedded(client, hf):
    prompt = make_prompts(1, min_len=96, max_len=96, seed=96)[0]
    out = client.embeddings.create(model=MODEL_NAME, input=prompt, encoding_format="float")
    assert_close(out.data[0].embedding, hf.embedding(prompt, "last"))


def test_embeddings_and_generation_run_together_in_one_server(client, server, hf, tokenizer):
    prompt = "The paged KV cache"
    alone = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )

    def generate() -> str:
        stream = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    def embed(i: int):
        return client.embeddings.create(model=MODEL_NAME, input=TEXTS[i % 3], encoding_format="float")

    with ThreadPoolExecutor(8) as pool:
        texts = [pool.submit(generate) for _ in range(2)]
        embeddings = [pool.submit(embed, i) for i in range(6)]
        assert [t.result() for t in texts] == [alone.choices[0].text] * 2
        for i, future in enumerate(embeddings):
            assert_close(future.result().data[0].embedding, hf.embedding(tokenizer.encode(TEXTS[i % 3]), "last"))
    stats = wait_until_idle(server)
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks and stats.blocks_used == 0


def metric(url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_embeddings_are_counted_in_the_metrics(client, server, tokenizer):
    def counts():
        return (
            metric(server.url, "pagedllm:request_success_total", finished_reason="stop"),
            metric(server.url, "pagedllm:prompt_tokens_total"),
            metric(server.url, "pagedllm:e2e_request_latency_seconds_count"),
        )

    before = counts()
    client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2], encoding_format="float")
    after = counts()
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS[:2])
    assert [b - a for a, b in zip(before, after)] == [2, tokens, 2]


def test_a_sentence_transformers_checkpoint_is_mean_pooled(tiny_llama, tmp_path, hf):
    model_dir = str(tmp_path / "st")
    shutil.copytree(tiny_llama, model_dir)
    write_sentence_transformers_pooling(model_dir, pooling_mode_mean_tokens=True)
    prompts = [make_prompts(1, min_len=n, max_len=n, seed=n)[0] for n in (5, 60)]
    with (
        live_server(model_dir, max_num_batched_tokens=16, max_num_seqs=16) as s,
        openai.OpenAI(base_url=f"{s.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c,
    ):
        out = c.embeddings.create(model=MODEL_NAME, input=prompts, encoding_format="float")
        for data, prompt in zip(out.data, prompts):
            assert_close(data.embedding, hf.embedding(prompt, "mean"))
        assert wait_until_idle(s).num_free_gpu_blocks == 1024
