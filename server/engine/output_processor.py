"""Outputs: new tokens into text, stop checks, and the :class:`RequestOutput` a caller sees."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.server.core.sequence import Logprobs, Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.detokenizer import decode_new_text
from pagedllm.server.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedllm.server.sampling_params import SamplingParams


class OutputProcessor:
    """Appends sampled tokens to sequences, finishes them by the request's rules, reports them.

    ``tokenizer`` may be None (``skip_tokenizer_init``): then no text is produced and
    stop strings never match.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append_token(
        self, seq: Sequence, token: int, logprob: float | None, top: Logprobs | None, params: SamplingParams
    ) -> None:
        """Append a sampled token, extend the text, and finish the sequence if a stop rule says so."""
        if top is not None and self.tokenizer is not None:
            for token_id, entry in top.items():
                entry.decoded_token = self.tokenizer.decode([token_id])
        self.append_text_token(seq, token, logprob, top, params)
        self._check_stop(seq, params)

    def append_text_token(
        self, seq: Sequence, token: int, logprob: float | None, top: Logprobs | None, params: SamplingParams
    ) -> None:
        """Append a token and its text, without stop checks (beam search decides its own ends)."""
        seq.append_token(token, logprob, top)
        if self.tokenizer is not None:
            seq.output_text += decode_new_text(self.tokenizer, seq, params.skip_special_tokens)

    def is_eos(self, token: int, params: SamplingParams) -> bool:
        return not params.ignore_eos and token in self.eos_token_ids

    def _check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        token = seq.output_token_ids[-1]
        num_out = len(seq.output_token_ids)
        may_stop = num_out >= params.min_tokens
        if may_stop and _stop_string_matched(seq, params):
            return
        if may_stop and token in params.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif may_stop and self.is_eos(token, params):
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif (params.max_tokens is not None and num_out >= params.max_tokens) or len(seq) >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    @staticmethod
    def request_output(group: SequenceGroup) -> RequestOutput:
        """The request's state now: its ``n`` completions (the best ones once finished)."""
        params = group.sampling_params
        finished = group.is_finished()
        seqs = group.seqs
        if finished and len(seqs) > params.n:
            # NOTE: beam search already orders its hypotheses by their length-normalised score.
            seqs = seqs if params.use_beam_search else sorted(seqs, key=lambda s: s.ranking_logprob, reverse=True)
        completions = [
            CompletionOutput(
                index=i,
                text=s.output_text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                finish_reason=s.status.value if s.status.finished else None,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(seqs[: params.n])
        ]
        prompt_logprobs = group.prompt_logprobs if params.prompt_logprobs is not None else None
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            prompt_logprobs,
            completions,
            finished,
            num_cached_tokens=group.num_cached_tokens,
        )

    @staticmethod
    def embedding_output(group: SequenceGroup, embedding: np.ndarray | None) -> EmbeddingRequestOutput:
        """An embedding request's state now: its embedding once its prompt is pooled."""
        vector = embedding.tolist() if embedding is not None else []
        return EmbeddingRequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, EmbeddingOutput(vector), group.is_finished()
        )


def _stop_string_matched(seq: Sequence, params: SamplingParams) -> bool:
    """Finish at the first stop string in the text, cutting the text there."""
    for stop in params.stop_list:
        index = seq.output_text.find(stop)
        if index >= 0:
            end = index + len(stop) if params.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:end]
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            return True
    return False
