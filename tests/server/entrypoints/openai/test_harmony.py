"""gpt-oss's harmony format: ``--reasoning-parser openai_gptoss`` and ``--tool-call-parser openai``.

The texts are those of the harmony format (openai/harmony and the gpt-oss model card): the
generation prompt ends in ``<|start|>assistant``, so the output starts at ``<|channel|>``;
``<|return|>`` and ``<|call|>`` end the output (as end-of-sequence tokens they may be missing).
Each is read whole and in pieces of every size.
"""

from __future__ import annotations

import json

import pytest
from scripted_sampler import scripted
from test_api_reasoning import ASK, MODEL, client_of, qwen3_dir, stream_deltas, written
from test_tool_calls import TOOLS
from test_tool_formats import accumulate, stream_text

from pagedllm.server.demo import build_byte_tokenizer
from pagedllm.server.entrypoints.openai.harmony import Header
from pagedllm.server.entrypoints.openai.reasoning_parser import FORMATS
from pagedllm.server.entrypoints.openai.tool_calls import plan

__all__ = ["qwen3_dir"]  # NOTE: a fixture shared with test_api_reasoning
pytestmark = pytest.mark.timeout(300)

PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>User asks the weather. Need the tool.<|end|>"
CALL = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
    '{"city": "Paris", "unit": "C"}<|call|>'
)
CALL_AFTER_CHANNEL = (
    '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"


def split(text: str, size: int):
    parser = FORMATS["openai_gptoss"].parser(PROMPT)
    deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), parser


@pytest.mark.parametrize(
    "text, reasoning, answer",
    [
        (ANALYSIS + FINAL, "User asks the weather. Need the tool.", "It is sunny in Paris."),
        (ANALYSIS + FINAL.removesuffix("<|return|>"), "User asks the weather. Need the tool.", "It is sunny in Paris."),
        (ANALYSIS + CALL, "User asks the weather. Need the tool.", CALL),  # NOTE: the call, whole, for the tool parser
        (
            "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>" + FINAL,
            "A.\n\nB.",
            "It is sunny in Paris.",
        ),
        ("<|channel|>analysis<|message|>Cut off while think", "Cut off while think", ""),
        ("Plain text, no harmony.", "", "Plain text, no harmony."),
        (
            ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL_AFTER_CHANNEL,
            "User asks the weather. Need the tool.",
            "Checking." + CALL_AFTER_CHANNEL,
        ),
    ],
)
def test_analysis_is_the_reasoning_however_the_text_is_cut(text, reasoning, answer):
    for size in (1, 2, 3, 5, 11, len(text)):
        assert split(text, size)[:2] == (reasoning, answer), size


def test_the_reasoning_ends_with_its_message():
    _, _, parser = split(ANALYSIS + FINAL, 4)
    assert parser.reasoning_end == len(ANALYSIS) and not parser.in_reasoning
    thinking = FORMATS["openai_gptoss"].parser(PROMPT)
    thinking.feed("<|channel|>analysis<|message|>Hmm")
    assert thinking.in_reasoning and thinking.reasoning_chars() == len("<|channel|>analysis<|message|>Hmm")
    markers = FORMATS["openai_gptoss"].markers(PROMPT)
    assert markers.opening == "reasoning" and "<|channel|>final<|message|>" in markers.ends


def test_the_recipient_is_read_before_or_after_the_channel():
    before = Header.read("<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json")
    after = Header.read("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert (
        (before.channel, before.recipient)
        == (after.channel, after.recipient)
        == ("commentary", "functions.get_weather")
    )
    assert Header.read("<|channel|>analysis").kind == "reasoning" and Header.read("<|channel|>final").kind == "answer"


PARIS = ("get_weather", {"city": "Paris", "unit": "C"})
CET = ("get_time", {"zone": "CET"})


@pytest.mark.parametrize(
    "text, content, expected",
    [
        (CALL, None, [PARIS]),
        (ANALYSIS + CALL, None, [PARIS]),  # NOTE: without the reasoning parser the analysis is dropped
        ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL_AFTER_CHANNEL, "Checking.", [CET]),
        (CALL.removesuffix("<|call|>"), None, [PARIS]),
        (
            "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|call|>" + CALL,
            None,
            [PARIS],
        ),  # NOTE: a built-in tool is not one of the request's functions
    ],
)
def test_openai_tool_parser_streams_the_calls_it_parses(text, content, expected):
    tool_plan = plan(TOOLS, "auto", tool_format="openai")
    parsed_content, parsed = tool_plan.parse(text)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == expected
    for size in (1, 2, 3, 7, len(text)):
        streamed_content, streamed = accumulate(stream_text(tool_plan, text, size))
        assert streamed_content == (content or "")
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in parsed]


def test_a_call_s_arguments_stream_as_they_arrive():
    parser = plan(TOOLS, "auto", tool_format="openai").parser()
    assert parser.feed("<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json<|mess") == []
    header, arguments = parser.feed('age|>{"zone"')
    assert header["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone"'}}]}
    assert parser.feed(': "CET"}<|ca') == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "CET"}'}}]}]
    assert parser.feed("ll|>") == [] and [c.arguments for c in parser.calls] == ['{"zone": "CET"}']


# -- served, through the openai client -----------------------------------------------------------------------
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


@pytest.fixture(scope="module")
def gptoss(qwen3_dir):
    settings = dict(reasoning_parser="openai_gptoss", tool_call_parser="openai", enable_auto_tool_choice=True)
    with client_of(qwen3_dir, HARMONY_TEMPLATE, **settings) as client:
        yield client


def test_a_served_model_s_analysis_and_call_come_apart_streamed_and_not(gptoss):
    with scripted() as scripts:
        whole = gptoss.chat.completions.create(messages=ASK, tools=TOOLS, **written(scripts, ANALYSIS + CALL))
        deltas, calls, usage = stream_deltas(gptoss, ASK, tools=TOOLS, **written(scripts, ANALYSIS + CALL))
        answer = gptoss.chat.completions.create(messages=ASK, **written(scripts, ANALYSIS + FINAL))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "User asks the weather. Need the tool."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [PARIS]
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(ANALYSIS.encode())
    assert "".join(t for k, t in deltas if k == "reasoning") == "User asks the weather. Need the tool."
    assert "".join(c.function.arguments or "" for c in calls) == '{"city": "Paris", "unit": "C"}'
    assert [k for k, _ in deltas] == ["reasoning"] * len(deltas)  # NOTE: no content: the call is no text
    assert usage.completion_tokens_details.reasoning_tokens == len(ANALYSIS.encode())
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.choices[0].message.model_extra["reasoning_content"] == "User asks the weather. Need the tool."


def test_a_json_schema_constrains_gpt_oss_s_final_message_only(gptoss):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}
    thinking = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>"
    with scripted() as scripts:
        scripts.next_request_writes(build_byte_tokenizer().encode(thinking, add_special_tokens=False))
        out = gptoss.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=len(thinking) + 40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        )
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == "User asks the weather. Need the tool."
    assert isinstance(json.loads(message.content)["sunny"], bool)


def test_reasoning_effort_reaches_the_template_from_chat_and_responses(gptoss):
    def chat(**extra):
        return gptoss.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **extra).usage.prompt_tokens

    def responses(**extra):
        return gptoss.responses.create(
            model=MODEL, input=ASK[0]["content"], max_output_tokens=1, **extra
        ).usage.input_tokens

    # NOTE: one token per byte: "Reasoning: high" is one token longer than "Reasoning: low"
    assert chat(reasoning_effort="high") - chat(reasoning_effort="low") == 1
    assert chat(reasoning_effort="high") - chat() == len("high") - len("medium")
    assert responses(reasoning={"effort": "high"}) - responses(reasoning={"effort": "low"}) == 1
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "low"}}
    assert chat(reasoning_effort="high", extra_body=kwargs) == chat(reasoning_effort="low")  # NOTE: the kwargs win


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_required_and_named_constrain_the_final_message(gptoss, choice):
    pytest.importorskip("xgrammar")
    thinking = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>"
    with scripted() as scripts:
        scripts.next_request_writes(build_byte_tokenizer().encode(thinking, add_special_tokens=False))
        out = gptoss.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[TOOLS[1]],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=len(thinking) + 200,
            temperature=0,
        )
    choice_out = out.choices[0]
    assert choice_out.message.model_extra["reasoning_content"] == "User asks the weather. Need the tool."
    assert choice_out.finish_reason == "tool_calls"
    ((call,),) = [choice_out.message.tool_calls]
    assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"zone"}
