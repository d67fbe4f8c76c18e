"""A grammar behind a reasoning block: free while the model thinks, exact from ``</think>`` on.

Driven through :class:`StructuredOutputs` with the byte tokenizer (one token per byte, so
``<think>`` is seven tokens and the gate must write its opening out and find ``</think>`` in
a decoded tail) and real xgrammar masks.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.server.demo import build_byte_tokenizer
from pagedllm.server.engine.reasoning_gate import ReasoningGate
from pagedllm.server.engine.structured_output import StructuredOutputs
from pagedllm.server.sampling_params import GuidedDecodingParams, ReasoningMarkers

pytest.importorskip("xgrammar")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
TOKENIZER = build_byte_tokenizer()
EOS = TOKENIZER.eos_token_id


def structured() -> StructuredOutputs:
    return StructuredOutputs(TOKENIZER, len(TOKENIZER), (EOS,))


def gate(opening: str):
    outputs = structured()
    markers = ReasoningMarkers(("<think>",), ("</think>",), opening)
    return outputs, outputs.matcher(outputs.compile(GuidedDecodingParams(json=SCHEMA, reasoning=markers)))


def allowed(outputs: StructuredOutputs, matcher) -> set[int] | None:
    (mask,) = outputs.masks([matcher])
    if mask is None:
        return None
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits[: len(TOKENIZER)])}


def write(outputs: StructuredOutputs, matcher, text: str) -> list[set[int] | None]:
    """Accept ``text`` token by token; the mask before each token (None: free) is returned."""
    masks = []
    for token in TOKENIZER.encode(text, add_special_tokens=False):
        mask = allowed(outputs, matcher)
        assert mask is None or token in mask, f"{TOKENIZER.decode([token])!r} was masked out"
        assert matcher.accept_token(token)
        masks.append(mask)
    return masks


def test_the_reasoning_is_free_and_the_answer_follows_the_schema():
    outputs, matcher = gate("either")
    first = allowed(outputs, matcher)
    assert first == {ord("{"), ord("<")}  # NOTE: the grammar's first token, or an opening <think>
    masks = write(outputs, matcher, "<think>")
    assert masks[1:] == [{ord(c)} for c in "think>"]  # the opening is written out
    masks = write(outputs, matcher, "\nNo JSON here: <b>, </thin, {{ ]\n</think>")
    assert all(m is None for m in masks) and not matcher.is_terminated()
    assert allowed(outputs, matcher) == {ord("{")}  # NOTE: the grammar applies from the end tag on
    write(outputs, matcher, '{"a": 42}')
    assert allowed(outputs, matcher) == {EOS}
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_an_answer_without_reasoning_is_constrained_from_its_first_token():
    outputs, matcher = gate("either")
    write(outputs, matcher, '{"a": ')
    assert matcher.state == "answer" and ord("<") not in allowed(outputs, matcher)
    assert not matcher.accept_token(ord("x"))
    write(outputs, matcher, "7}")
    assert allowed(outputs, matcher) == {EOS}


def test_a_block_the_prompt_opened_is_free_until_it_closes():
    outputs, matcher = gate("reasoning")
    assert all(m is None for m in write(outputs, matcher, "{not yet} <think> still\n</think>"))
    assert allowed(outputs, matcher) == {ord("{")}


def test_thinking_turned_off_leaves_a_plain_matcher():
    outputs, matcher = gate("answer")
    assert not isinstance(matcher, ReasoningGate) and allowed(outputs, matcher) == {ord("{")}


def test_a_token_outside_the_first_mask_is_refused():
    outputs, matcher = gate("either")
    assert not matcher.accept_token(ord("x")) and matcher.state == "either"
    write(outputs, matcher, "<")
    assert not matcher.accept_token(ord("x"))  # NOTE: the opening text must be written out


def test_markers_are_checked():
    with pytest.raises(ValueError, match="opening"):
        ReasoningMarkers(("<think>",), ("</think>",), "later")
    with pytest.raises(ValueError, match="ends"):
        ReasoningMarkers(("<think>",), (), "either")
