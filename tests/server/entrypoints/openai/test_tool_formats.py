"""``--tool-call-parser`` formats, each driven with the exact text its model family writes.

Sources of the texts: Mistral's tokenizer formats (v3, Mistral-7B-Instruct-v0.3:
``[TOOL_CALLS] [{"name": ..., "arguments": {...}}]``; v11+, Mistral-Small-3.2 / Magistral:
``[TOOL_CALLS]name[ARGS]{...}``); Qwen3-Coder's chat template (``<tool_call>\\n<function=…>\\n
<parameter=…>\\n…\\n</parameter>\\n</function>\\n</tool_call>``); the Llama-3.2 / Llama-4 model
cards' pythonic calls (``[func(a=1, b="x")]``, Llama-4 inside ``<|python_start|>…<|python_end|>``);
IBM Granite 3.0's ``<|tool_call|>[…]``; InternLM2.5's
``<|action_start|><|plugin|>\\n{…}<|action_end|>``; AI21 Jamba 1.5's
``<tool_calls>[…]</tool_calls>``. Each is parsed whole and streamed in pieces of every size,
which must add up to the same content and calls.
"""

from __future__ import annotations

import json

import pytest
from test_tool_calls import TOOLS

from pagedllm.server.config import ConfigError
from pagedllm.server.entrypoints.cli import main
from pagedllm.server.entrypoints.openai.settings import ServerSettings
from pagedllm.server.entrypoints.openai.tool_calls import plan
from pagedllm.server.entrypoints.openai.tool_format_xml import typed_value
from pagedllm.server.entrypoints.openai.tool_formats import TOOL_CALL_PARSERS

PARIS = ("get_weather", {"city": "Paris", "unit": "C"})
CET = ("get_time", {"zone": "CET"})
QWEN3_CODER_TWO_CALLS = (
    "Checking both.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
)
CASES = [
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        None,
        [PARIS, CET],
    ),
    (
        "mistral",
        'Both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        "Both.",
        [PARIS, CET],
    ),
    ("mistral", "No calls [TOOL here.", "No calls [TOOL here.", []),
    ("qwen3_coder", QWEN3_CODER_TWO_CALLS, "Checking both.", [PARIS, CET]),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\nDone.",
        "Done.",
        [("get_time", {})],
    ),
    ("qwen3_coder", "Text with <tool_ but no call.", "Text with <tool_ but no call.", []),
    ("pythonic", '[get_weather(city="Paris", unit=\'C\'), get_time(zone="CET")]', None, [PARIS, CET]),
    ("pythonic", '<|python_start|>[get_time(zone="CET")]<|python_end|>', None, [CET]),
    ("pythonic", "[1, 2] is a list.", "[1, 2] is a list.", []),
    ("pythonic", "[print(x=1)]", "[print(x=1)]", []),  # NOTE: not one of the tools: text
    (
        "granite",
        '<|tool_call|>[{"arguments": {"city": "Paris", "unit": "C"}, "name": "get_weather"}]',
        None,
        [PARIS],
    ),
    ("granite", '<tool_call>[{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [CET]),
    (
        "internlm",
        'Let me check.<|action_start|><|plugin|>\n{"name": "get_time", "parameters": {"zone": "CET"}}<|action_end|>',
        "Let me check.",
        [CET],
    ),
    (
        "jamba",
        'Two.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_calls>',
        "Two.",
        [PARIS, CET],
    ),
    ("llama4_pythonic", '<|python_start|>[get_time(zone="CET")]<|python_end|>', None, [CET]),
    (
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        None,
        [CET],
    ),
]


def accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """(content, calls) from streamed deltas, checking the shape the ``openai`` client relies on."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            if part["index"] == len(calls):
                assert set(part) == {"index", "id", "type", "function"} and part["function"]["arguments"] == ""
                calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return content, calls


def stream_text(tool_plan, text: str, size: int) -> list[dict]:
    parser = tool_plan.parser()
    deltas = []
    for start in range(0, len(text), size):
        deltas += parser.feed(text[start : start + size])
    return deltas + parser.finish()


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_each_format_streams_the_calls_it_parses_however_the_text_is_cut(name, text, content, expected):
    tool_plan = plan(TOOLS, "auto", tool_format=name)
    parsed_content, parsed = tool_plan.parse(text)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == expected
    for size in (1, 2, 3, 5, 13, len(text)):
        deltas = stream_text(tool_plan, text, size)
        streamed_content, streamed = accumulate(deltas)
        assert streamed_content == (parsed_content or "")
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in parsed]
        if size == 1 and expected:
            assert sum(1 for d in deltas for p in d.get("tool_calls") or [] if "id" not in p) >= len(expected)


def test_qwen3_coder_streams_one_parameter_at_a_time_typed_by_the_schema():
    parser = plan(TOOLS, "auto", tool_format="qwen3_coder").parser()
    assert parser.feed("<tool_call>\n<function=get_wea") == []
    (header,) = parser.feed("ther>\n<parameter=city>\nPar")
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert parser.feed("is\n</parameter>\n") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]}
    ]
    assert parser.feed("<parameter=unit>\nC\n</parameter>\n</function>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "unit": "C"}'}}]}
    ]
    number = {"type": "integer"}
    assert typed_value("42", number) == 42 and typed_value("4 2", number) == "4 2"
    assert typed_value("true", {"type": "boolean"}) is True
    assert typed_value("{'a': [1, 2]}", {"type": "object"}) == {"a": [1, 2]}
    assert typed_value("42", {"type": "string"}) == "42" and typed_value("42", None) == "42"


def test_mistral_ids_are_nine_letters_and_digits_as_its_templates_require():
    (call,) = plan(TOOLS, "auto", tool_format="mistral").parse('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}')[1]
    assert len(call.id) == 9 and call.id.isalnum()


def test_parallel_tool_calls_false_keeps_the_first_call_in_every_format():
    for name, text, _, expected in CASES:
        if len(expected) > 1:
            tool_plan = plan(TOOLS, "auto", parallel=False, tool_format=name)
            assert [c.name for c in tool_plan.parse(text)[1]] == [expected[0][0]], name
            assert [c["name"] for c in accumulate(stream_text(tool_plan, text, 4))[1]] == [expected[0][0]], name


def test_required_and_named_read_the_grammar_s_json_whatever_the_format():
    for name in TOOL_CALL_PARSERS:
        required = plan(TOOLS, "required", tool_format=name)
        _, calls = required.parse('[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})], name
        named = plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, tool_format=name)
        assert [(c.name, c.arguments) for c in named.parse('{"zone": "CET"}')[1]] == [("get_time", '{"zone": "CET"}')]
        assert not required.needs_special_tokens and not named.needs_special_tokens
    assert plan(TOOLS, "auto", tool_format="mistral").needs_special_tokens
    assert not plan(TOOLS, "auto", tool_format="qwen3_coder").needs_special_tokens


# -- start-up ---------------------------------------------------------------------------------------------
def test_an_unknown_parser_name_is_refused_naming_the_value_and_the_known_ones():
    with pytest.raises(ConfigError) as info:
        ServerSettings(tool_call_parser="hermes2")
    assert info.value.field == "tool_call_parser" and info.value.value == "hermes2"
    assert str(info.value) == (
        "tool_call_parser='hermes2' is not allowed: choose one of "
        "['hermes', 'llama3_json', 'mistral', 'qwen3_coder', 'pythonic', 'granite', 'internlm', 'jamba', "
        "'llama4_pythonic', 'openai']"
    )
    with pytest.raises(ConfigError) as info:
        ServerSettings(reasoning_parser="r1")
    assert str(info.value) == (
        "reasoning_parser='r1' is not allowed: choose one of "
        "['deepseek_r1', 'qwen3', 'deepseek_v3', 'glm45', 'granite', 'mistral', 'openai_gptoss']"
    )
    with pytest.raises(ConfigError, match="enable_auto_tool_choice=True needs a tool-call parser"):
        ServerSettings(enable_auto_tool_choice=True)
    assert ServerSettings(tool_call_parser="mistral", enable_auto_tool_choice=True, reasoning_parser="qwen3")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--tool-call-parser", "nope"], "--tool-call-parser='nope' is not allowed: choose one of ['hermes', "),
        (["--reasoning-parser", "nope"], "--reasoning-parser='nope' is not allowed: choose one of ['deepseek_r1', "),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice=True needs a tool-call parser"),
    ],
)
def test_the_command_line_refuses_a_bad_parser_before_loading_the_model(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err
