"""LoRA adapters over HTTP: ``model`` picks the adapter on every endpoint, /v1/models lists them,
runtime loading and unloading, the errors (404 unknown, 400 wrong base) and the metrics."""

from __future__ import annotations

import httpx
import pytest
from api_factories import CHAT_TEMPLATE, MODEL_NAME, engine_config, live_server
from engine_factories import HFReference
from lora_factories import save_random_adapter
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from pagedllm.server.config import ConfigError
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.entrypoints.openai.api_server import build_app
from pagedllm.server.entrypoints.openai.serving_lora import parse_lora_modules, runtime_updates_allowed
from pagedllm.server.entrypoints.openai.settings import ServerSettings

PROMPT = [5, 77, 120, 33, 9, 200, 41]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("api-lora")
    base = save_tiny_llama(str(root / "base"), seed=4, initializer_range=0.2, **SHAPE)
    other = save_tiny_llama(str(root / "other"), seed=5, hidden_size=32, intermediate_size=64)
    return {
        "base": base,
        "sql": save_random_adapter(base, str(root / "sql"), seed=1, merged_dir=str(root / "merged-sql")),
        "merged-sql": str(root / "merged-sql"),
        "chat": save_random_adapter(base, str(root / "chat"), seed=2, rank=4, targets=("q_proj", "v_proj")),
        "late": save_random_adapter(base, str(root / "late"), seed=3, merged_dir=str(root / "merged-late")),
        "merged-late": str(root / "merged-late"),
        "wrong": save_random_adapter(other, str(root / "wrong"), seed=4),
    }


@pytest.fixture(scope="module")
def server(dirs):
    modules = {name: dirs[name] for name in ("sql", "chat", "wrong")}
    settings = ServerSettings(
        served_model_names=[MODEL_NAME],
        chat_template=CHAT_TEMPLATE,
        lora_modules=modules,
        allow_runtime_lora_updating=True,
    )
    with live_server(dirs["base"], settings, enable_lora=True, max_loras=2) as live:
        yield live


def complete(url: str, model: str, max_tokens: int = 6) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def expected_text(model_dir: str, tokenizer_dir: str, max_tokens: int = 6) -> str:
    tokens = HFReference(model_dir).greedy(PROMPT, max_tokens)
    return AutoTokenizer.from_pretrained(tokenizer_dir).decode(tokens, skip_special_tokens=True)


def assert_same_text(text: str, full: str) -> None:
    # NOTE: random bytes; a character cut off by the last token is held back, as in a stream.
    assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}, (text, full)


def test_model_picks_the_adapter(server, dirs):
    reply = complete(server.url, "sql")
    assert reply.status_code == 200, reply.text
    assert_same_text(reply.json()["choices"][0]["text"], expected_text(dirs["merged-sql"], dirs["base"]))
    base = complete(server.url, MODEL_NAME).json()["choices"][0]["text"]
    assert_same_text(base, expected_text(dirs["base"], dirs["base"]))


def test_chat_and_responses_take_an_adapter(server):
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": "chat", "messages": messages, "max_tokens": 4, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    body = {"model": "sql", "input": "hello", "max_output_tokens": 4}
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text


def test_models_lists_adapters_with_their_parent(server, dirs):
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    cards = {card["id"]: card for card in data}
    assert cards[MODEL_NAME]["parent"] is None
    for name in ("sql", "chat"):
        assert cards[name]["parent"] == MODEL_NAME
        assert cards[name]["root"] == dirs[name]


def test_unknown_adapter_is_404_naming_it(server):
    reply = complete(server.url, "nosuch")
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert "`nosuch` does not exist" in error["message"] and "sql" in error["message"]
    assert error["param"] == "model"


def test_wrong_base_adapter_is_400(server):
    reply = complete(server.url, "wrong")
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "model"
    assert "LoRA adapter 'wrong'" in error["message"] and "does not fit the loaded model" in error["message"]


def test_adapters_load_and_unload_at_run_time(server, dirs):
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": dirs["wrong"]})
    assert bad.status_code == 400 and "does not fit" in bad.json()["error"]["message"]
    assert complete(server.url, "bad").status_code == 404
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": dirs["late"]})
    assert loaded.status_code == 200, loaded.text
    again = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": dirs["late"]})
    assert again.status_code == 400
    assert_same_text(
        complete(server.url, "late").json()["choices"][0]["text"], expected_text(dirs["merged-late"], dirs["base"])
    )
    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unloaded.status_code == 200, unloaded.text
    assert complete(server.url, "late").status_code == 404
    missing = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert missing.status_code == 404 and "`late` cannot be found" in missing.json()["error"]["message"]


def test_metrics_report_adapters(server):
    complete(server.url, "chat", max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    info = families["vllm:lora_requests_info"].samples[0]
    assert info.labels["max_lora"] == "2"
    assert set(info.labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    counts = {
        s.labels["lora_name"]: s.value for s in families["pagedllm:lora_requests"].samples if "lora_name" in s.labels
    }
    assert counts["chat"] >= 1


def test_runtime_updates_need_the_environment_switch(dirs):
    config = engine_config(dirs["base"], enable_lora=True)
    paths = {route.path for route in build_app(config, ServerSettings()).routes}
    assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths
    paths = {route.path for route in build_app(config, ServerSettings(allow_runtime_lora_updating=True)).routes}
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths
    assert runtime_updates_allowed({"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    assert not runtime_updates_allowed({})


def test_lora_modules_need_enable_lora(dirs):
    with pytest.raises(ConfigError, match="needs LoRA, which is off: add --enable-lora"):
        build_app(engine_config(dirs["base"]), ServerSettings(lora_modules={"sql": dirs["sql"]}))


def test_lora_modules_flag_values():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="name=path"):
        parse_lora_modules(["nopath"])
    with pytest.raises(ConfigError, match="repeats a name"):
        parse_lora_modules(["a=/x", "a=/y"])
