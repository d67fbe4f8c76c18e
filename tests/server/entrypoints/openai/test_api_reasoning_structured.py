"""Structured outputs and forced tool calls constrain the answer only: the reasoning before it is free text.

A served tiny Qwen3-shaped model (random weights, byte tokenizer) whose reasoning is scripted
(:mod:`scripted_sampler`): the scripted ``<think>`` block holds text no schema would allow,
and the answer after it is the model's own masked draws, which must follow the schema.
"""

from __future__ import annotations

import json

import pytest
from scripted_sampler import scripted
from test_api_reasoning import ASK, MODEL, QWEN3_TEMPLATE, R1_TEMPLATE, client_of, qwen3_dir, stream_deltas
from test_tool_calls import TOOLS

from pagedllm.server.demo import build_byte_tokenizer

__all__ = ["qwen3_dir"]  # NOTE: a fixture shared with test_api_reasoning

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("xgrammar")
TOKENIZER = build_byte_tokenizer()
THOUGHT = "Answer in JSON: {city} is not JSON yet ]]"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


def tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def check(answer: str) -> None:
    value = json.loads(answer)
    assert set(value) == {"city", "sunny"} and value["city"] in ("Paris", "Rome")
    assert isinstance(value["sunny"], bool)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    with client_of(qwen3_dir, QWEN3_TEMPLATE, reasoning_parser="qwen3", tool_call_parser="hermes") as client:
        yield client


def test_a_json_schema_constrains_the_answer_after_free_reasoning(qwen3):
    thinking = tokens(f"<think>\n{THOUGHT}\n</think>")
    request = dict(model=MODEL, max_tokens=len(thinking) + 60, temperature=0, response_format=FORMAT)
    with scripted() as scripts:
        scripts.next_request_writes(thinking)
        whole = qwen3.chat.completions.create(messages=ASK, **request)
        scripts.next_request_writes(thinking)
        deltas, _, usage = stream_deltas(qwen3, ASK, **request)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and whole.choices[0].finish_reason == "stop"
    check(message.content)
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(thinking)
    assert "".join(t for k, t in deltas if k == "reasoning") == THOUGHT
    assert "".join(t for k, t in deltas if k == "content") == message.content  # NOTE: greedy: the same answer
    assert usage.completion_tokens_details.reasoning_tokens == len(thinking)


def test_without_reasoning_the_schema_applies_from_the_first_token(qwen3):
    request = dict(model=MODEL, max_tokens=60, temperature=0, response_format=FORMAT)
    off = qwen3.chat.completions.create(
        messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **request
    )
    check(off.choices[0].message.content)
    assert off.choices[0].message.model_extra["reasoning_content"] is None


def test_tool_choice_required_calls_after_the_reasoning(qwen3):
    thinking = tokens("<think>\nI need a tool.\n</think>")
    with scripted() as scripts:
        scripts.next_request_writes(thinking)
        out = qwen3.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[TOOLS[1]],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=0,
        )
    choice = out.choices[0]
    assert choice.message.model_extra["reasoning_content"] == "I need a tool."
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert choice.message.tool_calls[0].function.name == TOOLS[1]["function"]["name"]


def test_a_block_the_template_opened_is_free_until_it_closes(qwen3_dir):
    thinking = tokens(f"{THOUGHT}\n</think>")  # NOTE: R1's template wrote <think> into the prompt
    request = dict(model=MODEL, max_tokens=len(thinking) + 60, temperature=0, response_format=FORMAT)
    with client_of(qwen3_dir, R1_TEMPLATE, reasoning_parser="deepseek_r1") as r1, scripted() as scripts:
        scripts.next_request_writes(thinking)
        out = r1.chat.completions.create(messages=ASK, **request)
    assert out.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    check(out.choices[0].message.content)
