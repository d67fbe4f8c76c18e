"""``/v1/responses`` through the official ``openai`` client, served from the demo model (it has a chat template).

The chat endpoint on the same messages is the reference: a Responses request is a chat
completion in another shape, so under temperature 0 both write the same text from the
same prompt (compared by token count, through ``/tokenize``).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_factories import CHAT_TEMPLATE, live_server

from pagedllm.server.demo import ensure_demo_model
from pagedllm.server.entrypoints.openai.settings import ServerSettings

pytestmark = pytest.mark.timeout(180)
MODEL = "demo"
QUESTION = "What does json.dumps do?"
SCHEMA = {
    "type": "object",
    "properties": {"module": {"enum": ["json", "os", "re"]}, "stable": {"type": "boolean"}},
    "required": ["module", "stable"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server():
    # NOTE: float32, as these answers were read (the bfloat16 checkpoint would run in bfloat16 on a
    # CPU with bf16 units, and its greedy answer to QUESTION does not end within 128 tokens).
    settings = ServerSettings(served_model_names=[MODEL])
    with live_server(ensure_demo_model(), settings, max_model_len=512, dtype="float32") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def chat(client, messages, max_tokens):
    """The chat endpoint's greedy answer to ``messages``: (text, finish_reason, prompt tokens)."""
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.prompt_tokens


def prompt_tokens(server, messages) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]


def greedy(client, **kwargs):
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


# -- text ----------------------------------------------------------------------------------------
def test_a_string_input_is_answered_as_the_chat_endpoint_answers_it(client):
    out = greedy(client, input=QUESTION, max_output_tokens=24)
    text, finish, prompt = chat(client, [{"role": "user", "content": QUESTION}], 24)
    assert out.output_text == text and text
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.status == ("incomplete" if finish == "length" else "completed")
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == out.status
    assert [(c.type, c.annotations) for c in message.content] == [("output_text", [])]
    usage = out.usage
    assert usage.input_tokens == prompt and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_streamed_deltas_add_up_to_the_non_streamed_text(client):
    whole = greedy(client, input=QUESTION, max_output_tokens=128)
    assert whole.status == "completed"  # NOTE: the demo model ends this answer on its own
    events = list(greedy(client, input=QUESTION, max_output_tokens=128, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")} | {final.output[0].id}
    assert len(item_ids) == 1
    # the client's own accumulator reads the events back into the same response
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=128, temperature=0) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        accumulated = stream.get_final_response()
    assert accumulated.output_text == whole.output_text == snapshots[-1] and accumulated.id != whole.id


def test_instructions_are_a_system_message_placed_first(client, server):
    instructions = "You answer in one short sentence."
    out = greedy(client, input=QUESTION, instructions=instructions, max_output_tokens=16)
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    text, _, prompt = chat(client, messages, 16)
    assert out.usage.input_tokens == prompt == prompt_tokens(server, messages)
    assert out.output_text == text and out.instructions == instructions


def test_input_items_with_text_parts_and_a_developer_message(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "What does "}, {"type": "input_text", "text": "os.path do?"}],
        },
    ]
    out = greedy(client, input=items, max_output_tokens=12)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does os.path do?"}]
    text, _, prompt = chat(client, messages, 12)
    assert out.output_text == text and out.usage.input_tokens == prompt


def test_max_output_tokens_leaves_the_response_incomplete(client):
    out = greedy(client, input="Explain Python's list comprehensions in detail.", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete"
    events = list(
        greedy(client, input="Explain Python's list comprehensions in detail.", max_output_tokens=3, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == out.output_text


# -- conversation state ----------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(client, server):
    first = greedy(client, input=QUESTION, instructions="Be brief.", max_output_tokens=16)
    second = greedy(client, input="And json.loads?", previous_response_id=first.id, max_output_tokens=16)
    # NOTE: instructions are not carried over to a follow-up, as in OpenAI's API
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And json.loads?"},
    ]
    text, _, prompt = chat(client, history, 16)
    assert second.usage.input_tokens == prompt == prompt_tokens(server, history)
    assert second.output_text == text and second.previous_response_id == first.id
    # a chain of three, with new instructions on the last
    third = greedy(
        client, input="Thanks.", instructions="Reply kindly.", previous_response_id=second.id, max_output_tokens=8
    )
    longer = [
        {"role": "system", "content": "Reply kindly."},
        *history,
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    assert third.usage.input_tokens == prompt_tokens(server, longer)
    assert third.output_text == chat(client, longer, 8)[0]
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text and stored.status == first.status


def test_a_streamed_response_is_stored_too(client, server):
    events = list(greedy(client, input=QUESTION, max_output_tokens=8, stream=True))
    first = events[-1].response
    follow = greedy(client, input="Why?", previous_response_id=first.id, max_output_tokens=4)
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Why?"},
    ]
    assert follow.usage.input_tokens == prompt_tokens(server, history)


def test_unknown_or_unstored_previous_response_id_is_a_400(client):
    unstored = greedy(client, input=QUESTION, max_output_tokens=2, store=False)
    assert unstored.store is False
    for response_id in (unstored.id, "resp_does_not_exist"):
        with pytest.raises(openai.BadRequestError) as info:
            greedy(client, input="Go on.", previous_response_id=response_id, max_output_tokens=2)
        error = info.value.body
        assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
        assert response_id in error["message"] and info.value.status_code == 400
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(response_id)
        assert missing.value.body["code"] == "response_not_found"


def test_the_store_keeps_the_last_responses_store_size(tiny_llama):
    settings = ServerSettings(served_model_names=["tiny"], chat_template=CHAT_TEMPLATE, responses_store_size=1)
    with live_server(tiny_llama, settings) as small:
        with openai.OpenAI(base_url=f"{small.url}/v1", api_key="none", max_retries=0) as tiny:
            first, second = (tiny.responses.create(input="hi", max_output_tokens=2) for _ in range(2))
            with pytest.raises(openai.BadRequestError, match="--responses-store-size"):
                tiny.responses.create(input="more", previous_response_id=first.id, max_output_tokens=2)
            assert tiny.responses.create(input="more", previous_response_id=second.id, max_output_tokens=2).output


def test_a_stream_that_fails_ends_with_an_error_event_the_client_raises(tiny_llama):
    settings = ServerSettings(served_model_names=["tiny"], chat_template=CHAT_TEMPLATE, request_timeout=0.001)
    with live_server(tiny_llama, settings) as small:
        body = {"input": "hi", "max_output_tokens": 64, "stream": True}
        text = httpx.post(f"{small.url}/v1/responses", json=body, timeout=30).text
        frames = [frame.split("\n") for frame in text.strip().split("\n\n")]
        events = [(name.removeprefix("event: "), json.loads(data.removeprefix("data: "))) for name, data in frames]
        assert all(name == event["type"] for name, event in events)  # no [DONE]: the last event ends it
        assert [event["sequence_number"] for _, event in events] == list(range(len(events)))
        assert events[0][0] == "response.created" and events[-1][0] == "error"
        error = events[-1][1]
        assert error["code"] == "504" and "--request-timeout" in error["message"] and error["error"]["code"] == 504
        with openai.OpenAI(base_url=f"{small.url}/v1", api_key="none", max_retries=0) as tiny:
            with pytest.raises(openai.APIError, match="--request-timeout"):
                list(tiny.responses.create(input="hi", max_output_tokens=64, stream=True))


# -- structured output and tools -------------------------------------------------------------------------
def test_text_format_json_schema_gives_valid_json(client):
    fmt = {"type": "json_schema", "name": "module", "schema": SCHEMA, "strict": True}
    out = client.responses.create(
        model=MODEL, input="Describe the json module.", text={"format": fmt}, max_output_tokens=120
    )
    valid(out.output_text)
    assert out.status == "completed" and out.text.format.type == "json_schema"
    events = list(
        client.responses.create(
            model=MODEL, input="Which module?", text={"format": fmt}, max_output_tokens=120, stream=True
        )
    )
    valid("".join(e.delta for e in events if e.type == "response.output_text.delta"))
    # NOTE: the demo model writes JSON strings longer than any budget; that the object began shows the grammar
    plain = greedy(client, input="Any JSON.", max_output_tokens=4)
    out = greedy(client, input="Any JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=4)
    assert out.output_text.startswith("{") and not plain.output_text.startswith("{")


def valid(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"module", "stable"} and value["module"] in ("json", "os", "re")
    assert isinstance(value["stable"], bool)


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and len(args["city"]) <= 12


def test_a_forced_function_yields_a_function_call_item(client, server):
    ask = "What is the weather in Paris?"
    named = {"type": "function", "name": "get_weather"}
    out = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice=named, max_output_tokens=80)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and out.status == "completed"
    check_weather(call.arguments)
    assert out.tools[0].name == "get_weather" and out.tool_choice.name == "get_weather"
    # the function's result goes back as input; the model answers in text
    follow = client.responses.create(
        model=MODEL,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}],
        previous_response_id=out.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert follow.output[0].type == "message" and follow.output_text
    history = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"},
    ]
    assert follow.usage.input_tokens == prompt_tokens(server, history)


def test_required_tool_call_streams_as_a_function_call_item(client):
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Oslo?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=80,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.arguments == ""
    check_weather(delta.delta)
    assert done.arguments == delta.delta == item_done.item.arguments == completed.response.output[0].arguments
    assert added.item.id == delta.item_id == item_done.item.id == completed.response.output[0].id
    with client.responses.stream(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_output_tokens=80
    ) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    check_weather(call.arguments)


# -- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"role": "narrator", "content": "hi"}]}, "input"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "hi", "temperature": -1}, "temperature"),
        ({"input": []}, "input"),
        ({}, "input"),
    ],
)
def test_invalid_requests_are_400s_naming_the_parameter(server, body, param):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi", max_output_tokens=2)
