"""Tool calls read from the model's text, streamed as the ``openai`` client accumulates them.

The parser is checked on its own over texts cut at every size, then end to end with the
``openai`` client on the demo model, where the grammar (a named function, ``required``, or
a ``guided_choice`` holding the exact text under ``auto``) makes the calls deterministic.
"""

from __future__ import annotations

import json

import pytest
from api_factories import live_server
from openai import OpenAI

from pagedllm.server.demo import ensure_demo_model
from pagedllm.server.entrypoints.openai.settings import ServerSettings
from pagedllm.server.entrypoints.openai.tool_calls import plan
from pagedllm.server.entrypoints.openai.tool_parser import ToolCallParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
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
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
TWO_CALLS = (
    "Checking both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """(content, calls) from streamed deltas, checking the shape the ``openai`` client relies on:
    a call's first delta names it with empty arguments, every later one adds only arguments."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            if part["index"] == len(calls):
                assert set(part) == {"index", "id", "type", "function"} and part["type"] == "function"
                assert part["function"]["arguments"] == "" and part["id"].startswith("call_")
                calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return content, calls


def stream_text(tool_plan, text: str, size: int) -> list[dict]:
    parser = ToolCallParser(tool_plan)
    deltas = []
    for start in range(0, len(text), size):
        deltas += parser.feed(text[start : start + size])
    return deltas + parser.finish()


@pytest.mark.parametrize(
    "choice, text, content, expected",
    [
        (
            "auto",
            TWO_CALLS,
            "Checking both.",
            [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})],
        ),
        (
            "auto",
            '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
            None,
            [("get_time", {"zone": "UTC"})],
        ),
        ("auto", '{"parameters": {"zone": "UTC"}, "name": "get_time"}', None, [("get_time", {"zone": "UTC"})]),
        (
            "auto",
            '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
            None,
            [("get_time", {"zone": "CET"})],
        ),
        ("auto", '{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),
        (
            "auto",
            "Plain <tool_ text, <tool_call>not json</tool_call> end ",
            "Plain <tool_ text, <tool_call>not json</tool_call> end ",
            [],
        ),
        (
            "required",
            '[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}]',
            None,
            [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "F"})],
        ),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"city": "Rome", "unit": "C"}',
            None,
            [("get_weather", {"city": "Rome", "unit": "C"})],
        ),
    ],
)
def test_streamed_calls_add_up_to_the_parsed_ones_however_the_text_is_cut(choice, text, content, expected):
    tool_plan = plan(TOOLS, choice)
    parsed_content, parsed = tool_plan.parse(text)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == expected
    for size in (1, 2, 5, 13, len(text)):
        streamed_content, streamed = accumulate(stream_text(tool_plan, text, size))
        assert streamed_content == (parsed_content or "")
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in parsed]


def test_arguments_stream_as_they_are_written_not_when_the_call_is_complete():
    parser = ToolCallParser(plan(TOOLS, "auto"))
    assert parser.feed('<tool_call>{"name": "get_wea') == []  # NOTE: held until the name is known
    header, first = parser.feed('ther", "arguments": {"ci')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert parser.feed("") == []
    assert parser.feed('ty": "Par') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Par'}}]}]


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    tool_plan = plan(TOOLS, "auto", parallel=False)
    content, calls = tool_plan.parse(TWO_CALLS)
    assert content == "Checking both." and [c.name for c in calls] == ["get_weather"]
    assert accumulate(stream_text(tool_plan, TWO_CALLS, 3))[1][0]["name"] == "get_weather"
    assert len(accumulate(stream_text(tool_plan, TWO_CALLS, 3))[1]) == 1
    schema = plan(TOOLS, "required", parallel=False).guided().json
    assert schema["maxItems"] == 1 and "maxItems" not in plan(TOOLS, "required").guided().json


# -- through the openai client ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    settings = ServerSettings(served_model_names=["demo"])
    with live_server(ensure_demo_model(), settings, max_model_len=512) as server:
        yield OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def streamed(client, **request):
    """The final message as the client's stream helper assembles it, and its arguments.delta events."""
    with client.chat.completions.stream(model="demo", messages=ASK, tools=TOOLS, **request) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    return final, [e for e in events if e.type == "tool_calls.function.arguments.delta"]


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize(
    "request_args",
    [
        dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0),
        dict(tool_choice="required", temperature=0),
        dict(tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3),
    ],
    ids=["named", "required", "required-one-call"],
)
def test_a_streamed_call_reassembles_into_the_non_streamed_one(client, request_args):
    whole = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=80, **request_args)
    final, fragments = streamed(client, max_tokens=80, **request_args)
    assert whole.choices[0].finish_reason == final.finish_reason == "tool_calls"
    assert calls_of(final.message) == calls_of(whole.choices[0].message) and calls_of(final.message)
    for name, arguments in calls_of(final.message):
        assert set(json.loads(arguments)) == set(
            next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]["required"]
        )
    assert len([f for f in fragments if f.arguments_delta]) > 1  # the arguments arrived in pieces
    assert final.message.content is None and whole.choices[0].message.content is None
    if request_args.get("parallel_tool_calls") is False:
        assert len(final.message.tool_calls) == 1


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_streams_text_then_each_call_with_its_own_index(client, parallel):
    request_args = dict(
        tool_choice="auto", max_tokens=200, parallel_tool_calls=parallel, extra_body={"guided_choice": [TWO_CALLS]}
    )
    whole = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, **request_args)
    final, fragments = streamed(client, **request_args)
    expected = [("get_weather", '{"city": "Paris", "unit": "C"}'), ("get_time", '{"zone": "CET"}')]
    expected = expected if parallel else expected[:1]
    assert calls_of(final.message) == calls_of(whole.choices[0].message) == expected
    assert final.message.content == whole.choices[0].message.content == "Checking both."
    assert [c.index for c in final.message.tool_calls] == list(range(len(expected)))
    assert len({c.id for c in final.message.tool_calls}) == len(expected)
    assert {f.index for f in fragments} == set(range(len(expected))) and len(fragments) > 2 * len(expected)
    assert final.finish_reason == whole.choices[0].finish_reason == "tool_calls"
