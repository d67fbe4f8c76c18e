"""Outputs: what new tokens do (text, stop checks) and the :class:`RequestOutput` a caller sees."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from typing import Any

import numpy as np

from pagedllm.server.core.sequence import Logprobs, Sequence, SequenceGroup, SequenceStatus, StopReason
from pagedllm.server.core.sequence_updates import SeqUpdate
from pagedllm.server.engine.detokenizer import decode_new_text, text_decoder
from pagedllm.server.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedllm.server.sampling_params import SamplingParams


class OutputProcessor:
    """Decides what sampled tokens do to a sequence: its text, and whether a stop rule ends it.

    It reads sequences only; the scheduler applies the :class:`SeqUpdate` it returns.
    ``tokenizer`` may be None (``skip_tokenizer_init``): then no text is produced and
    stop strings never match.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def decide(
        self,
        seq: Sequence,
        token_ids: Sequence_[int],
        logprobs: Sequence_[float | None] | None,
        tops: Sequence_[Logprobs | None] | None,
        params: SamplingParams,
        check_stops: bool = True,
    ) -> SeqUpdate:
        """Appending ``token_ids`` to ``seq`` with their text, up to the first one a stop rule ends it
        at (``check_stops=False``: all of them; beam search decides its own ends).

        ``logprobs`` and ``tops``: per token, its log-probability and the top alternatives (None: not
        asked for); the alternatives get their text here.
        """
        decode = self._decode
        text, prefix, read = seq.output_text, seq.prefix_offset, seq.read_offset
        length, start = len(seq.token_ids), prefix
        # NOTE: the detokenizer reads from prefix_offset on; without one nothing is copied
        tail = seq.token_ids[prefix:] if decode is not None else []
        num_out = len(seq.output_token_ids)
        finish: SequenceStatus | None = None
        reason: StopReason = None
        n = 0
        for token in token_ids:
            n += 1
            if decode is not None:
                tail.append(token)
                top = tops[n - 1] if tops is not None else None
                if top is not None:
                    for token_id, entry in top.items():
                        entry.decoded_token = decode([token_id], False)
                new, prefix, read = decode_new_text(decode, tail, start, prefix, read, params.skip_special_tokens)
                text += new
            if check_stops:
                finish, reason, text = self._stop(token, num_out + n, length + n, text, params)
                if finish is not None:
                    break
        return SeqUpdate(
            seq.seq_id,
            tuple(token_ids[:n]),
            tuple(logprobs[:n]) if logprobs is not None else (None,) * n,
            tuple(tops[:n]) if tops is not None else (),
            text if decode is not None else None,
            (prefix, read) if decode is not None else None,
            finish,
            reason,
        )

    def is_eos(self, token: int, params: SamplingParams) -> bool:
        return not params.ignore_eos and token in self.eos_token_ids

    def _stop(
        self, token: int, num_out: int, length: int, text: str, params: SamplingParams
    ) -> tuple[SequenceStatus | None, StopReason, str]:
        """The verdict after ``token`` (the ``num_out``-th output, ``length`` tokens in all), its
        reason, and the text (cut at a stop string)."""
        if num_out >= params.min_tokens:
            for stop in params.stop_list:  # NOTE: finish at the first stop string in the text
                index = text.find(stop)
                if index >= 0:
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    return SequenceStatus.FINISHED_STOPPED, stop, text[:end]
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token, text
            if self.is_eos(token, params):
                return SequenceStatus.FINISHED_STOPPED, None, text
        if (params.max_tokens is not None and num_out >= params.max_tokens) or length >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None, text
        return None, None, text

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
