"""Reasoning read apart from the answer (``--reasoning-parser``), on the exact text each family writes.

Texts follow the models' published chat templates: Qwen3 writes ``<think>\\n…\\n</think>\\n\\n``
before its answer, and its template closes an empty block (``<think>\\n\\n</think>\\n\\n``) when
``enable_thinking`` is false; DeepSeek-R1's template ends the prompt with
``<｜Assistant｜><think>\\n``, so its output holds only ``</think>``; DeepSeek-V3.1's ends it in
``<think>`` (thinking) or ``</think>`` (not); GLM-4.5's closes ``<think></think>`` when
``enable_thinking`` is false; IBM Granite 3.2 (with
``thinking=True``) writes ``Here is my thought process:`` … ``Here is my response:``.
"""

from __future__ import annotations

import pytest

from pagedllm.server.demo import build_byte_tokenizer
from pagedllm.server.entrypoints.openai.reasoning_parser import FORMATS, REASONING_PARSERS, count_tokens

QWEN3_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_OFF = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜><think>\n"
R1_OLD_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜>"
GRANITE_PROMPT = "<|start_of_role|>assistant<|end_of_role|>"
V31_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜>"
GLM_PROMPT = "[gMASK]<sop><|user|>\nWeather in Paris?<|assistant|>"
# NOTE: Magistral's system prompt asks for [THINK]...[/THINK]; the prompt itself opens no block
MAGISTRAL_PROMPT = (
    "<s>[SYSTEM_PROMPT]First draft your thinking process inside [THINK] and [/THINK].[/SYSTEM_PROMPT]"
    "[INST]Weather in Paris?[/INST]"
)


def split(name: str, prompt: str, text: str, size: int) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, answer, the non-empty deltas) of ``text`` fed ``size`` characters at a time."""
    parser = FORMATS[name].parser(prompt)
    deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    pairs = [(d.reasoning, d.content) for d in deltas if d.reasoning or d.content]
    return "".join(r for r, _ in pairs), "".join(c for _, c in pairs), pairs


@pytest.mark.parametrize(
    "name, prompt, text, reasoning, answer",
    [
        (
            "qwen3",
            QWEN3_PROMPT,
            "<think>\nParis is in France.\n</think>\n\nIt is sunny.",
            "Paris is in France.",
            "It is sunny.",
        ),
        ("qwen3", QWEN3_OFF, "It is sunny.", "", "It is sunny."),
        ("qwen3", QWEN3_PROMPT, "It is sunny, no <think> here.", "", "It is sunny, no <think> here."),
        ("qwen3", QWEN3_PROMPT + "<think>\n", "Paris.\n</think>\n\nSunny.", "Paris.", "Sunny."),  # Qwen3-2507
        ("qwen3", QWEN3_PROMPT, "<think>\nStill thinking when cut", "Still thinking when cut", ""),
        (
            "deepseek_r1",
            R1_PROMPT,
            "Paris is in France.\n</think>\n\nIt is sunny.",
            "Paris is in France.",
            "It is sunny.",
        ),
        ("deepseek_r1", R1_OLD_PROMPT, "<think>\nParis.\n</think>Sunny.", "Paris.", "Sunny."),
        (
            "deepseek_r1",
            R1_OLD_PROMPT,
            "Paris, without an opening tag.</think>Sunny.",
            "Paris, without an opening tag.",
            "Sunny.",
        ),
        ("deepseek_r1", R1_PROMPT, "Cut off < before the end", "Cut off < before the end", ""),
        (
            "granite",
            GRANITE_PROMPT,
            "Here is my thought process:\nParis is in France.\nHere is my response:\nIt is sunny.",
            "Paris is in France.",
            "It is sunny.",
        ),
        ("granite", GRANITE_PROMPT, "Here's my thought process:\nA.\nHere's my response:\nB.", "A.", "B."),
        ("granite", GRANITE_PROMPT, "It is sunny.", "", "It is sunny."),
        ("deepseek_v3", V31_PROMPT + "<think>", "Paris.</think>Sunny.", "Paris.", "Sunny."),
        ("deepseek_v3", V31_PROMPT + "</think>", "Sunny, no </think> read.", "", "Sunny, no </think> read."),
        ("glm45", GLM_PROMPT, "\n<think>Paris.</think>\nSunny.", "Paris.", "Sunny."),
        ("glm45", GLM_PROMPT + "\n<think></think>", "\nSunny.", "", "\nSunny."),
        (
            "mistral",
            MAGISTRAL_PROMPT,
            "[THINK]Paris is in France.[/THINK]It is sunny.",
            "Paris is in France.",
            "It is sunny.",
        ),
        ("mistral", MAGISTRAL_PROMPT, "[THINK]\nA.\n[/THINK]\n\nB.", "A.", "B."),
        ("mistral", MAGISTRAL_PROMPT, "It is sunny, [THINK] later is text.", "", "It is sunny, [THINK] later is text."),
        ("mistral", MAGISTRAL_PROMPT, "[THINK]Cut off [/THI", "Cut off [/THI", ""),
    ],
)
def test_reasoning_and_answer_are_the_same_however_the_text_is_cut(name, prompt, text, reasoning, answer):
    for size in (1, 2, 3, 4, 7, len(text)):
        assert split(name, prompt, text, size)[:2] == (reasoning, answer), size


def test_tags_cut_in_the_middle_are_held_back_until_the_next_piece_tells():
    parser = FORMATS["qwen3"].parser(QWEN3_PROMPT)
    steps = [
        ("<thi", ("", "")),
        ("nk>\nWe need", ("We need", "")),
        (" X.\n</th", (" X.", "")),
        ("ink>\n\nIt", ("", "It")),
    ]
    for piece, expected in steps:
        delta = parser.feed(piece)
        assert (delta.reasoning, delta.content) == expected, piece
    delta = parser.finish()
    assert (delta.reasoning, delta.content) == ("", "")
    assert (parser.reasoning, parser.content) == ("We need X.", "It")
    assert parser.reasoning_end == len("<think>\nWe need X.\n</think>")


def test_a_false_start_of_a_tag_is_text_again():
    _, _, deltas = split("deepseek_r1", R1_PROMPT, "a </b> c</think>d", 2)
    assert "".join(r for r, _ in deltas) == "a </b> c" and "".join(c for _, c in deltas) == "d"
    assert split("qwen3", QWEN3_PROMPT, "<thinking is text", 3)[:2] == ("", "<thinking is text")


def test_where_the_output_begins_is_read_from_the_prompt():
    assert FORMATS["qwen3"].opening(QWEN3_PROMPT) == "either"
    assert FORMATS["qwen3"].opening(QWEN3_PROMPT + "<think>\n") == "reasoning"
    assert FORMATS["qwen3"].opening(QWEN3_OFF) == "answer"
    assert FORMATS["deepseek_r1"].opening(R1_OLD_PROMPT) == "reasoning"
    assert FORMATS["deepseek_r1"].opening(R1_PROMPT) == "reasoning"
    # an earlier turn's reasoning in the history does not leave the block open
    history = QWEN3_PROMPT + "<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n"
    assert FORMATS["qwen3"].opening(history) == "either"
    assert REASONING_PARSERS == ("deepseek_r1", "qwen3", "deepseek_v3", "glm45", "granite", "mistral", "openai_gptoss")


def test_reasoning_tokens_are_the_tokens_up_to_the_closing_tag():
    tokenizer = build_byte_tokenizer()
    text = "<think>\nab\n</think>\n\nanswer"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # NOTE: one token per byte, so the count is exact
    parser = FORMATS["qwen3"].parser(QWEN3_PROMPT)
    parser.feed(text, final=True)
    assert count_tokens(tokenizer, ids, parser.reasoning_chars()) == len("<think>\nab\n</think>")
    assert count_tokens(tokenizer, ids, 0) == 0 and count_tokens(tokenizer, ids, 10**6) == len(ids)
