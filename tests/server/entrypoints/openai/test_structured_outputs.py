"""Structured outputs through the OpenAI client on the demo model: the grammar guarantees the shape."""

from __future__ import annotations

import json

import pytest
from api_factories import live_server
from openai import BadRequestError, OpenAI

from pagedllm.server.demo import ensure_demo_model
from pagedllm.server.entrypoints.openai.settings import ServerSettings

SCHEMA = {
    "type": "object",
    "properties": {
        "module": {"type": "string", "enum": ["json", "os", "re"]},
        "stable": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["module", "stable", "tags"],
    "additionalProperties": False,
}


def valid(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"module", "stable", "tags"} and value["module"] in ("json", "os", "re")
    assert isinstance(value["stable"], bool) and len(value["tags"]) <= 2
    assert all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])
    return value


@pytest.fixture(scope="module")
def client():
    settings = ServerSettings(served_model_names=["demo"])
    with live_server(ensure_demo_model(), settings, max_model_len=512) as server:
        yield OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_json_schema_response_format_non_streamed_and_n2(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "module", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Describe the json module."}],
        response_format=fmt,
        max_tokens=120,
        n=2,
        temperature=1.0,
        seed=3,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content)


def test_json_schema_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "module", "schema": SCHEMA}}
    chunks = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Which module?"}],
        response_format=fmt,
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    valid(text)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0  # include_usage


def test_guided_choice_and_completions_json(client):
    out = client.completions.create(
        model="demo", prompt="Is json a module? Answer:", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert out.choices[0].text in ("yes", "no")
    out = client.completions.create(
        model="demo", prompt="The os module", max_tokens=120, extra_body={"guided_json": SCHEMA}
    )
    valid(out.choices[0].text)


def test_an_empty_schema_is_refused_not_left_waiting(client):
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", max_tokens=3, timeout=30, extra_body={"guided_json": ""})
    assert info.value.body["param"] == "guided_json"
    empty = client.completions.create(model="demo", prompt="x", max_tokens=3, extra_body={"guided_regex": ""})
    assert empty.choices[0].text == ""  # NOTE: an empty regex is a grammar: it matches only the empty text


def test_logit_bias_forces_a_token(client):
    import httpx

    forced = 1000
    base = str(client.base_url).removesuffix("/v1/")
    text = httpx.post(f"{base}/detokenize", json={"tokens": [forced]}).json()["prompt"]
    plain = client.completions.create(model="demo", prompt="Hello", max_tokens=3, temperature=0)
    assert plain.choices[0].text != text * 3
    out = client.completions.create(
        model="demo", prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert out.choices[0].text == text * 3


def test_continuous_usage_stats(client):
    chunks = list(
        client.completions.create(
            model="demo",
            prompt="The for statement",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},  # NOTE: sampled, the demo model may end before 5 tokens
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 5


# -- tool calling ------------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and len(args["city"]) <= 12


def test_a_named_tool_call_has_arguments_that_match_its_schema(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="demo", messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=80
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(call.function.arguments)


def test_required_picks_one_of_the_tools_and_streams_it(client):
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, stream=True
        )
    )
    calls: dict[int, list[str]] = {}  # index -> [name, arguments], put together from the fragments
    for delta in (call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])):
        name, arguments = calls.setdefault(delta.index, ["", ""])
        calls[delta.index] = [name + (delta.function.name or ""), arguments + (delta.function.arguments or "")]
    assert sorted(calls) == list(range(len(calls))) and calls
    for name, arguments in calls.values():
        assert name in ("get_weather", "get_time")
        json.loads(arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_in_the_history_are_accepted(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    out = client.chat.completions.create(
        model="demo", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=10
    )
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize(
    "text, name, args",
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', "get_time", {"zone": "UTC"}),
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}',
            "get_weather",
            {"city": "Oslo", "unit": "C"},
        ),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "get_time", {"zone": "CET"}),
    ],
)
def test_auto_reads_hermes_and_llama3_calls(text, name, args):
    from pagedllm.server.entrypoints.openai.tool_calls import plan

    content, calls = plan([WEATHER, TIME], "auto").parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]
    assert plan([WEATHER], "auto").parse("It is sunny.") == ("It is sunny.", [])
    assert plan([WEATHER], "auto").parse('{"name": "unknown_tool"}') == ('{"name": "unknown_tool"}', [])


def test_echo_with_logprobs_streams_the_prompt_logprobs_first(client):
    args = dict(model="demo", prompt="The for statement", max_tokens=4, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and logprobs[0] is None
    assert logprobs == whole.logprobs.token_logprobs
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_chat_streams_n_choices(client):
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=ASK, n=2, max_tokens=6, temperature=1.0, seed=2, stream=True
        )
    )
    choices = [choice for c in chunks for choice in c.choices]
    indexes = {choice.index for choice in choices}
    finished = [choice for choice in choices if choice.finish_reason]
    assert indexes == {0, 1} and sorted(f.index for f in finished) == [0, 1]


def test_a_grammar_survives_preemption():
    from pagedllm.server import LLM, SamplingParams
    from pagedllm.server.sampling_params import GuidedDecodingParams

    llm = LLM(block_size=8, num_gpu_blocks_override=24, max_num_seqs=8, preemption_mode="recompute")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=120, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    outputs = llm.generate([f"Module number {i}:" for i in range(8)], params)
    assert llm.llm_engine.stats().num_preemptions > 0
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        valid(output.outputs[0].text)
