"""Outputs as deltas: after every step, the deltas sent so far rebuild the in-process engine's output exactly."""

from __future__ import annotations

import pytest
from api_factories import engine_config

from pagedllm.server import SamplingParams
from pagedllm.server.core.sequence import SequenceGroup
from pagedllm.server.engine import core_messages as msg
from pagedllm.server.engine.llm_engine import LLMEngine
from pagedllm.server.engine.output_deltas import DeltaMaker, OutputAccumulator
from pagedllm.server.engine.output_processor import OutputProcessor

pytestmark = pytest.mark.timeout(300)

CASES = {
    "greedy-logprobs": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
    "prompt-logprobs": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2),
    "stop-string": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["e", "o "]),
    "stop-after-min-tokens": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["e"], min_tokens=6),
    "stop-kept": SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=["e"], include_stop_str_in_output=True
    ),
    "n-best-of": SamplingParams(n=2, best_of=4, temperature=1.0, seed=7, max_tokens=9, logprobs=1, ignore_eos=True),
    "n-random": SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=7, ignore_eos=True),
    "beam": SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=8, logprobs=1),
    "beam-eos": SamplingParams(use_beam_search=True, best_of=4, n=4, temperature=0, max_tokens=10),
}
PROMPTS = ["hello world, here we go", "the quick brown fox", "a"]


class BothOutputs:
    """Reports each group both ways: the whole output, and a delta sent through msgpack and rebuilt."""

    def __init__(self) -> None:
        self.maker = DeltaMaker()
        self.accumulator = OutputAccumulator()
        self.pairs: list[tuple[object, object]] = []

    def __call__(self, group: SequenceGroup):
        whole = OutputProcessor.request_output(group)
        delta = self.maker(group)
        wire = msg.decode_outputs(msg.encode(msg.StepOutputs(0.0, 1.0, [delta]))).deltas[0]
        self.pairs.append((whole, self.accumulator.add(wire)))
        return whole


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with LLMEngine(engine_config(tiny_llama)) as engine:
        yield engine


@pytest.mark.parametrize("case", sorted(CASES))
def test_deltas_rebuild_every_step_output(engine, case):
    both = BothOutputs()
    engine.request_output = both
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{case}-{i}", {"prompt": prompt}, CASES[case])
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.request_output = OutputProcessor.request_output
    assert len(both.pairs) > len(PROMPTS)
    for whole, rebuilt in both.pairs:
        assert rebuilt == whole
    assert len(both.accumulator) == 0, "finished requests are forgotten"
    finished = [whole for whole, _ in both.pairs if whole.finished]
    assert len(finished) == len(PROMPTS)


def test_deltas_send_only_what_is_new(engine):
    maker = DeltaMaker()
    engine.request_output = maker
    sent: list[int] = []
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine.add_request("new-only", {"prompt": "hello"}, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                sent.append(len(delta.choices[0].token_ids))
                assert (delta.prompt_token_ids is not None) == (len(sent) == 1), "the prompt goes once"
    finally:
        engine.request_output = OutputProcessor.request_output
    assert sent == [1] * 6


def test_a_stop_string_found_late_cuts_text_already_sent():
    """min_tokens delays the stop check, so the cut falls before text an earlier delta carried."""
    from pagedllm.server.core.sequence import Sequence

    params = SamplingParams(max_tokens=10, stop=["b"], min_tokens=3)
    seq = Sequence(0, [1, 2])
    group = SequenceGroup("late", [seq], params, prompt="p")
    maker, accumulator = DeltaMaker(), OutputAccumulator()
    for token, text in [(5, "ab"), (6, "cd")]:
        seq.append_token(token, -0.5, None)
        seq.output_text += text
        assert accumulator.add(maker(group)).outputs[0].text == seq.output_text
    seq.output_text = "a"  # what the stop check leaves once the stop string may end the sequence
    seq.status = type(seq.status).FINISHED_STOPPED
    rebuilt = accumulator.add(maker(group))
    assert rebuilt == OutputProcessor.request_output(group)
    assert rebuilt.outputs[0].text == "a" and rebuilt.finished


def test_forgotten_requests_drop_their_later_deltas():
    params = SamplingParams(max_tokens=10)
    from pagedllm.server.core.sequence import Sequence

    seq = Sequence(0, [1, 2])
    group = SequenceGroup("gone", [seq], params, prompt=None)
    maker, accumulator = DeltaMaker(), OutputAccumulator()
    seq.append_token(5, -0.1, None)
    assert accumulator.add(maker(group)) is not None
    accumulator.forget(["gone"])
    seq.append_token(6, -0.1, None)
    assert accumulator.add(maker(group)) is None
    assert len(accumulator) == 0
