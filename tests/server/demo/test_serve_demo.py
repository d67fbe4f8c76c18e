"""The embedded demo model: shipped, small, LLaMA with its own tokenizer and chat template, readable."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from api_factories import live_server

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.demo import SHIPPED_DEMO_DIR, ensure_demo_model
from pagedllm.server.engine.model_info import default_sampling
from pagedllm.server.entrypoints.openai.api_server import ServerSettings

pytestmark = pytest.mark.timeout(180)
COMMON_WORDS = {"the", "is", "a", "of", "to", "and", "in", "object", "function", "module", "class", "value", "if"}


def test_the_shipped_demo_model_is_served_without_a_model_flag():
    path = ensure_demo_model()
    assert path == SHIPPED_DEMO_DIR
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size <= 20 * 1024 * 1024, f"the demo model is {size / 2**20:.1f} MiB"
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama"
    # the server samples with the model's own defaults when a request leaves them unset
    assert default_sampling(path) == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    text = "def f(x):\n    return json.dumps({'ü': x})  # ünïcode"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_the_demo_model_writes_readable_text():
    llm = LLM()  # no model: the demo
    params = SamplingParams(temperature=0, max_tokens=48, min_tokens=32)
    prompts = ["The for statement", "A list comprehension", "The json module"]
    for output in llm.generate(prompts, params):
        text = output.outputs[0].text
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 5, text
        printable = sum(c.isalpha() or c in " .,;:()\"'`*\n-_" for c in text) / max(1, len(text))
        assert printable >= 0.8, text
        assert COMMON_WORDS & {w.lower() for w in words}, text


def test_demo_chat_over_http():
    settings = ServerSettings()
    with live_server(None, settings) as server:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["pagedllm-demo"]
        body = {
            "messages": [{"role": "user", "content": "What does json.dumps do?"}],
            "max_tokens": 32,
            "temperature": 0,
        }
        out = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        answer = out["choices"][0]["message"]["content"]
        assert len(re.findall(r"[A-Za-z]+", answer)) >= 3, answer


def test_the_training_script_runs_offline(tmp_path):
    from pagedllm.server.demo import train as demo_train

    texts, chats = demo_train.build_corpus()
    assert len(texts) > 500 and len(chats) > 500
    out = tmp_path / "model"
    demo_train.main(
        [
            "--out",
            str(out),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--vocab-size",
            "600",
            "--hidden-size",
            "32",
            "--intermediate-size",
            "64",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
        ]
    )
    llm = LLM(model=str(out))
    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n")
    assert llm.generate("The", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids


def test_without_the_package_data_a_random_model_is_built_with_a_warning(monkeypatch, tmp_path, caplog):
    from pagedllm.server import demo

    monkeypatch.setattr(demo, "SHIPPED_DEMO_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="pagedllm.demo"):
        path = demo.ensure_demo_model()
    assert path.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(path, "config.json"))
    assert "missing" in caplog.text
    assert demo.ensure_demo_model() == path  # built once
