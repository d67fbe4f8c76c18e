"""Reasoning and tool calls through the ``openai`` client, from a served tiny Qwen3-shaped model.

The model has random weights and a byte tokenizer (one token per byte, so every stream is cut
at every character, inside ``</think>`` and inside each tag); its output is forced with a
``guided_choice`` of the exact text a Qwen3 or DeepSeek-R1 model writes (the grammar takes the
opening ``<`` itself, so it constrains the reasoning too), or scripted (:mod:`scripted_sampler`). The chat templates
below keep the parts of the published Qwen3 and DeepSeek-R1 templates that matter here: tools
listed in the system turn, ``enable_thinking=false`` closing an empty ``<think>`` block, and
R1 opening the block after ``<｜Assistant｜>``.
"""

from __future__ import annotations

import contextlib
import json

import openai
import pytest
from api_factories import live_server, serve_process
from family_factories import save_tiny_family
from scripted_sampler import scripted
from test_tool_calls import TOOLS

from pagedllm.server.demo import build_byte_tokenizer
from pagedllm.server.entrypoints.openai.settings import ServerSettings

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
R1_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- else %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
)
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "The user asks about Paris."
THINK_THEN_ANSWER = f"<think>\n{THOUGHT}\n</think>\n\nIt is sunny in Paris."
QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return save_tiny_family(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3")


@contextlib.contextmanager
def client_of(model_dir: str, template: str, **settings):
    settings = ServerSettings(served_model_names=[MODEL], chat_template=template, **settings)
    with live_server(model_dir, settings, max_model_len=1024) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120) as client:
            yield client


@pytest.fixture(scope="module")
def client(qwen3_dir):
    with client_of(qwen3_dir, QWEN3_TEMPLATE, reasoning_parser="qwen3", tool_call_parser="qwen3_coder") as c:
        yield c


def forced(text: str, **request) -> dict:
    """Request arguments that make the model write exactly ``text`` (then its end-of-sequence token)."""
    return dict(model=MODEL, max_tokens=len(text.encode()) + 8, extra_body={"guided_choice": [text]}, **request)


def written(scripts, text: str) -> dict:
    """Request arguments for a request the scripted sampler makes write ``text`` (then end-of-sequence)."""
    tokenizer = build_byte_tokenizer()
    scripts.next_request_writes(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])
    return dict(model=MODEL, max_tokens=len(text.encode()) + 8)


def stream_deltas(client, messages, **request) -> tuple[list[tuple[str, str]], list, object]:
    """The (kind, text) of each streamed delta in order, the tool-call parts, and the usage chunk's usage."""
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **request
        )
    )
    deltas, calls = [], []
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                deltas.append(("reasoning", extra["reasoning_content"]))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
            calls += choice.delta.tool_calls or []
    assert chunks[-1].choices == []
    return deltas, calls, chunks[-1].usage


def _reasoning_of(chunk) -> str:
    return "".join((c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunk.choices)


def joined(deltas, kind: str) -> str:
    return "".join(text for k, text in deltas if k == kind)


# -- chat completions ------------------------------------------------------------------------------------------
def test_reasoning_comes_apart_from_the_answer_streamed_and_not(client):
    whole = client.chat.completions.create(messages=ASK, **forced(THINK_THEN_ANSWER))
    message = whole.choices[0].message
    assert message.content == "It is sunny in Paris." and whole.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == THOUGHT
    spent = len(f"<think>\n{THOUGHT}\n</think>".encode())  # NOTE: one token per byte
    assert whole.usage.completion_tokens_details.reasoning_tokens == spent
    deltas, calls, usage = stream_deltas(client, ASK, **forced(THINK_THEN_ANSWER))
    assert joined(deltas, "reasoning") == THOUGHT and joined(deltas, "content") == "It is sunny in Paris."
    kinds = [k for k, _ in deltas]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all the reasoning comes first
    assert kinds.count("reasoning") > 1 and calls == []  # it arrived as it was written
    assert usage.completion_tokens_details.reasoning_tokens == spent
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_tool_call_after_the_reasoning_is_read_from_the_answer_only(client):
    text = f"<think>\nI need the weather tool.\n</think>\n\n{QWEN3_CODER_CALL}"
    whole = client.chat.completions.create(messages=ASK, tools=TOOLS, **forced(text))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I need the weather tool."
    ((name, arguments),) = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert (name, arguments) == ("get_weather", '{"city": "Paris", "unit": "C"}')
    with client.chat.completions.stream(messages=ASK, tools=TOOLS, **forced(text)) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [(name, arguments)]
    fragments = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    # NOTE: a parameter streams when its </parameter> is read; outputs a slow reader missed come together
    assert "".join(fragments) == arguments and len([f for f in fragments if f]) > 1
    reasoning_at = [i for i, e in enumerate(events) if e.type == "chunk" and _reasoning_of(e.chunk)]
    first_call = next(i for i, e in enumerate(events) if e.type == "tool_calls.function.arguments.delta")
    assert reasoning_at and max(reasoning_at) < first_call
    assert final.finish_reason == "tool_calls"


def test_the_request_s_tools_and_chat_template_kwargs_reach_the_template(client):
    plain = client.chat.completions.create(messages=ASK, **forced("It is sunny."))
    tools_text = "<|im_start|>system\n# Tools\n\n<tools>"
    tools_text += "".join("\n" + json.dumps(t, ensure_ascii=False) for t in TOOLS) + "\n</tools><|im_end|>\n"
    with_tools = client.chat.completions.create(messages=ASK, tools=TOOLS, **forced("It is sunny."))
    assert with_tools.usage.prompt_tokens - plain.usage.prompt_tokens == len(tools_text.encode())
    off = client.chat.completions.create(
        messages=ASK,
        model=MODEL,
        max_tokens=20,
        extra_body={"guided_choice": ["It is sunny."], "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens - plain.usage.prompt_tokens == len("<think>\n\n</think>\n\n")
    assert off.choices[0].message.content == "It is sunny."
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            messages=ASK, model=MODEL, max_tokens=4, extra_body={"chat_template_kwargs": {"tools": []}}
        )
    assert info.value.body["param"] == "chat_template_kwargs" and "['tools']" in info.value.body["message"]


def test_tool_choice_required_and_named_still_work_with_the_parsers(client):
    required = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[TOOLS[1]],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    )
    for out in (required, named):
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] is None
        assert choice.message.tool_calls and out.usage.completion_tokens_details.reasoning_tokens == 0
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    assert set(json.loads(named.choices[0].message.tool_calls[0].function.arguments)) == {"zone"}


# -- responses ---------------------------------------------------------------------------------------------
def test_the_responses_api_returns_a_reasoning_item_before_the_message(client):
    request = dict(
        model=MODEL,
        input="Weather in Paris?",
        max_output_tokens=80,
        extra_body={"structured_outputs": {"choice": [THINK_THEN_ANSWER]}},
    )
    out = client.responses.create(**request)
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert message.type == "message" and out.output_text == "It is sunny in Paris."
    assert out.usage.output_tokens_details.reasoning_tokens == len(f"<think>\n{THOUGHT}\n</think>".encode())
    events = list(client.responses.create(stream=True, **request))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == THOUGHT and len(deltas) > 1
    done = kinds.index("response.reasoning_text.done")
    assert kinds.index("response.output_item.added") < kinds.index("response.reasoning_text.delta") < done
    assert done < kinds.index("response.output_text.delta")  # NOTE: the reasoning item ends before the answer
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == out.output_text
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [i.id for i in final.output]
    # the stored answer, reasoning included, continues a conversation
    follow = client.responses.create(
        model=MODEL,
        input="And tomorrow?",
        previous_response_id=out.id,
        max_output_tokens=40,
        extra_body={"structured_outputs": {"choice": ["<think>\nSame.\n</think>\n\nRain."]}},
    )
    assert follow.output_text == "Rain." and follow.output[0].content[0].text == "Same."


def test_the_responses_api_takes_chat_template_kwargs_as_chat_does(client):
    def prompt_tokens(**extra):
        out = client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=1, **extra)
        return out.usage.input_tokens

    off = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off - prompt_tokens() == len("<think>\n\n</think>\n\n")
    with pytest.raises(openai.BadRequestError) as info:
        prompt_tokens(extra_body={"chat_template_kwargs": {"tools": []}})
    assert info.value.body["param"] == "chat_template_kwargs"


# -- deepseek_r1 -------------------------------------------------------------------------------------------
def test_deepseek_r1_output_starts_inside_the_block_its_template_opened(qwen3_dir):
    # NOTE: scripted, not forced by a grammar: a grammar would constrain only the answer after </think>
    text = f"{THOUGHT}\n</think>\n\n" + '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    answer_text = f"{THOUGHT}\n</think>\n\nSunny."
    settings = dict(reasoning_parser="deepseek_r1", tool_call_parser="mistral", enable_auto_tool_choice=True)
    with client_of(qwen3_dir, R1_TEMPLATE, **settings) as r1, scripted() as scripts:
        whole = r1.chat.completions.create(messages=ASK, tools=TOOLS, **written(scripts, text))
        message = whole.choices[0].message
        assert message.model_extra["reasoning_content"] == THOUGHT and message.content is None
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            ("get_time", '{"zone": "CET"}')
        ]
        assert len(message.tool_calls[0].id) == 9
        # NOTE: special tokens are kept for [TOOL_CALLS]; the end-of-sequence token's text is not content
        answer = r1.chat.completions.create(messages=ASK, tools=TOOLS, **written(scripts, answer_text))
        assert answer.choices[0].message.content == "Sunny." and answer.choices[0].finish_reason == "stop"
        deltas, calls, _ = stream_deltas(r1, ASK, tools=TOOLS, **written(scripts, answer_text))
        assert joined(deltas, "content") == "Sunny." and calls == []
        assert whole.usage.completion_tokens_details.reasoning_tokens == len(f"{THOUGHT}\n</think>".encode())
        deltas, calls, usage = stream_deltas(r1, ASK, **written(scripts, answer_text))
        assert joined(deltas, "reasoning") == THOUGHT and joined(deltas, "content") == "Sunny."
        assert [k for k, _ in deltas][-1] == "content" and calls == []


# -- mistral (Magistral) ---------------------------------------------------------------------------------------
def test_magistral_s_think_block_and_call_come_apart_streamed_and_not(qwen3_dir):
    text = '[THINK]The user wants the time.[/THINK][TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    settings = dict(reasoning_parser="mistral", tool_call_parser="mistral", enable_auto_tool_choice=True)
    with client_of(qwen3_dir, QWEN3_TEMPLATE, **settings) as magistral, scripted() as scripts:
        whole = magistral.chat.completions.create(messages=ASK, tools=TOOLS, **written(scripts, text))
        deltas, calls, usage = stream_deltas(magistral, ASK, tools=TOOLS, **written(scripts, text))
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants the time." and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_time", '{"zone": "CET"}')]
    assert joined(deltas, "reasoning") == "The user wants the time." and joined(deltas, "content") == ""
    assert "".join(c.function.arguments or "" for c in calls) == '{"zone": "CET"}'
    spent = len(b"[THINK]The user wants the time.[/THINK]")
    assert whole.usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens_details.reasoning_tokens
    assert usage.completion_tokens_details.reasoning_tokens == spent


# -- pagedllm serve ------------------------------------------------------------------------------------------
def test_pagedllm_serve_takes_the_flags_and_a_chat_template_file(qwen3_dir, tmp_path):
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3_TEMPLATE)
    flags = ("--chat-template", str(template), "--reasoning-parser", "qwen3")
    flags += ("--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice")
    text = f"<think>\n{THOUGHT}\n</think>\n\n{QWEN3_CODER_CALL}"
    with serve_process(qwen3_dir, *flags) as (_, url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as served:
            out = served.chat.completions.create(messages=ASK, tools=TOOLS, **forced(text))
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "C"}')
    ]
