"""Output processing decides (text, stop checks) and leaves the sequence to the scheduler."""

from __future__ import annotations

from pagedllm.server.core.sequence import Sequence, SequenceStatus
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.sampling_params import SamplingParams


class Letters:
    """A tokenizer of one letter per token id (0 -> 'a')."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_deciding_reads_the_sequence_and_stops_at_the_first_verdict():
    seq = Sequence(0, [0, 1, 2])
    update = OutputProcessor(None, (4,), 100).decide(seq, (5, 4, 6), (-1.0, -2.0, -3.0), None, SamplingParams())
    assert update.token_ids == (5, 4) and update.logprobs == (-1.0, -2.0) and update.top_logprobs == ()
    assert update.finish is SequenceStatus.FINISHED_STOPPED and update.stop_reason is None
    assert update.output_text is None and update.offsets is None  # no tokenizer: no text
    assert seq.output_token_ids == [] and seq.token_ids == [0, 1, 2] and seq.status is SequenceStatus.WAITING


def test_text_is_decided_incrementally_and_cut_at_a_stop_string():
    processor = OutputProcessor(Letters(), (), 100)
    seq = Sequence(0, [0, 1, 2])
    params = SamplingParams(stop=["fg"], max_tokens=10)
    update = processor.decide(seq, (3, 4, 5, 6, 7), None, None, params)
    assert update.token_ids == (3, 4, 5, 6) and update.output_text == "de" and update.stop_reason == "fg"
    assert update.offsets == (6, 7) and update.finish is SequenceStatus.FINISHED_STOPPED
    assert seq.output_text == "" and (seq.prefix_offset, seq.read_offset) == (0, 3)


def test_without_stop_checks_every_token_is_taken_and_length_limits_apply_otherwise():
    processor = OutputProcessor(Letters(), (1,), 5)
    seq = Sequence(0, [0, 1, 2])
    free = processor.decide(seq, (1, 1, 1), None, None, SamplingParams(), check_stops=False)
    assert free.token_ids == (1, 1, 1) and free.finish is None and free.output_text == "bbb"
    capped = processor.decide(seq, (3, 3, 3), None, None, SamplingParams(ignore_eos=True))
    assert capped.token_ids == (3, 3) and capped.finish is SequenceStatus.FINISHED_LENGTH  # max_model_len 5
    stopped = processor.decide(seq, (3, 9), None, None, SamplingParams(stop_token_ids=[9], min_tokens=1))
    assert stopped.token_ids == (3, 9) and stopped.stop_reason == 9
