"""What every OpenAI endpoint shares: checks, sampling parameters, running requests, streaming.

:mod:`serving_completion` and :mod:`serving_chat` build on :class:`OpenAIServing`; the
differences between the two endpoints (prompt shape, choice shape) are passed in, so
their streams run through one implementation (:meth:`OpenAIServing.stream`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.server.config import ConfigError
from pagedllm.server.engine.async_engine import AsyncLLMEngine
from pagedllm.server.engine.input_processor import check_token_ids
from pagedllm.server.engine.model_info import ModelInfo
from pagedllm.server.engine.request_stream import EngineDeadError, RequestStream
from pagedllm.server.entrypoints.openai.errors import APIError, bad_request, from_config_error, unavailable
from pagedllm.server.entrypoints.openai.protocol import SamplingFields, UsageInfo
from pagedllm.server.entrypoints.openai.sse import SSEResponse, sse_response
from pagedllm.server.outputs import CompletionOutput, RequestOutput
from pagedllm.server.sampling_params import SamplingParams


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class Delta:
    """What a streamed choice gained since the last chunk."""

    text: str
    token_start: int
    token_end: int
    finish_reason: str | None
    stop_reason: Any


@dataclass
class Tracker:
    """What one choice already sent to a streaming client."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """Endpoint-specific progress (the completion endpoint's echo and text offset)."""

    def advance(self, c: CompletionOutput, holdback: int, with_tokens: bool) -> Delta | None:
        """The news in ``c``, or None if there is nothing to send.

        NOTE: the last ``holdback`` characters wait until the choice finishes, because
        they may yet turn out to begin a stop string, which is never sent.
        """
        if self.finished:
            return None
        end = len(c.text) if c.finish_reason else max(self.text_len, len(c.text) - holdback)
        text = c.text[self.text_len : end]
        new_tokens = len(c.token_ids) > self.num_tokens
        if not text and not (with_tokens and new_tokens) and not c.finish_reason:
            return None
        delta = Delta(text, self.num_tokens, len(c.token_ids), c.finish_reason, c.stop_reason)
        self.text_len, self.num_tokens, self.finished = end, len(c.token_ids), c.finish_reason is not None
        return delta


ChoiceMaker = Callable[[int, int, CompletionOutput, Tracker], dict[str, Any] | None]
"""(prompt index, choice index, output, tracker) -> a chunk's choice, or None for nothing new."""


@dataclass
class OpenAIServing:
    """The engine as the OpenAI endpoints use it."""

    engine: AsyncLLMEngine
    served_model_names: list[str]
    chat_template: str | None = None
    max_queue_len: int | None = None
    draining: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        info = self.engine.model_info
        if info is None:
            raise unavailable(f"the server is not ready: {self.engine.not_ready_reason()}")
        return info

    # -- checks ---------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist: this server serves {self.served_model_names}",
                param="model",
                code="model_not_found",
            )

    def check_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down: retry on another replica")
        if not self.engine.is_ready:
            raise unavailable(f"the server is not ready: {self.engine.not_ready_reason()}")

    def check_queue(self, num_new: int) -> None:
        waiting = self.engine.num_unscheduled
        if self.max_queue_len is not None and waiting + num_new > self.max_queue_len:
            raise unavailable(
                f"the waiting queue is full ({waiting} waiting, --max-queue-len={self.max_queue_len}): retry later"
            )

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer (--skip-tokenizer-init): send token ids")
        return self.tokenizer

    def check_token_ids(self, ids: list[int], param: str) -> None:
        try:
            check_token_ids(ids, param, self.model_info.vocab_size)
        except ConfigError as exc:
            raise from_config_error(exc) from exc

    def check_length(self, prompt: Prompt, max_tokens: int | None, param: str) -> None:
        limit = self.model_info.max_model_len
        n = len(prompt.token_ids)
        if max_tokens is not None and n < limit < n + max_tokens:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the prompt or {param}.",
                param,
            )

    # -- sampling parameters ------------------------------------------------------------------------
    def sampling_params(
        self, req: SamplingFields, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`, the model's generation_config filling what it left unset."""
        if req.logit_bias:
            raise bad_request("logit_bias is not supported by this server: leave it empty", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options can only be set when stream=true", "stream_options")
        values = dict(
            n=req.n,
            best_of=req.best_of,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            use_beam_search=req.use_beam_search,
            length_penalty=req.length_penalty,
        )
        info = self.model_info
        for key, value in info.default_sampling.items():
            if values.get(key) is None:
                values[key] = value  # NOTE: the model's generation_config fills what the request left unset
        values = {k: v for k, v in values.items() if v is not None or k in ("max_tokens", "logprobs")}
        top_k = values.get("top_k")
        if isinstance(top_k, int) and top_k > info.vocab_size:
            values["top_k"] = info.vocab_size  # NOTE: same distribution, keeps all tokens
        try:
            params = SamplingParams(**values)  # type: ignore[arg-type]
        except ConfigError as exc:
            raise from_config_error(exc) from exc
        if req.stream and params.best_of > params.n:
            raise bad_request(f"best_of={params.best_of} must equal n={params.n} when streaming", "best_of")
        return params

    # -- running requests -----------------------------------------------------------------------------
    async def start(
        self, request_id: str, prompts: list[Prompt], params: SamplingParams, param_names: Mapping[str, str]
    ) -> list[RequestStream]:
        """Add one engine request per prompt; on any failure the ones added are aborted.

        ``param_names`` maps engine fields to this request's parameter names for errors.
        """
        self.check_ready()
        self.check_queue(len(prompts))
        streams: list[RequestStream] = []
        now = time.monotonic()
        try:
            for i, prompt in enumerate(prompts):
                engine_prompt = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                streams.append(await self.engine.add_request(f"{request_id}-{i}", engine_prompt, params, now))
        except ConfigError as exc:
            raise from_config_error(exc, param_names) from exc
        except EngineDeadError as exc:
            raise unavailable(str(exc)) from exc
        finally:
            if len(streams) < len(prompts):
                self.abort(streams)
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.abort(stream.request_id)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        async def last(stream: RequestStream) -> RequestOutput:
            output = None
            async for latest in self.engine.iterate(stream):
                output = latest
            assert output is not None, "a stream ends with a finished output or an error"
            return output

        try:
            return list(await asyncio.gather(*(last(s) for s in streams)))
        except EngineDeadError as exc:
            raise unavailable(str(exc)) from exc
        finally:
            self.abort(streams)

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they come."""
        if len(streams) == 1:
            try:
                async for output in streams[0]:
                    yield 0, output
            finally:
                self.abort(streams)  # NOTE: a no-op for finished requests
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for output in self.engine.iterate(stream):
                    queue.put_nowait((i, output, None))
            except BaseException as exc:  # noqa: BLE001 (forwarded to the consumer)
                queue.put_nowait((i, None, exc))
                return
            queue.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item, error = await queue.get()
                if error is not None:
                    raise error
                if item is None:
                    remaining -= 1
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            self.abort(streams)

    # -- streaming --------------------------------------------------------------------------------------
    def stream(
        self,
        request_id: str,
        object_name: str,
        prompts: list[Prompt],
        params: SamplingParams,
        streams: list[RequestStream],
        include_usage: bool,
        make_choice: ChoiceMaker,
        first_choices: list[dict[str, Any]] | None = None,
    ) -> SSEResponse:
        """The SSE response of a streaming request: one chunk per step with news, then usage if asked."""
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], usage: UsageInfo | None = None) -> dict[str, Any]:
            body: dict[str, Any] = {
                "id": request_id,
                "object": object_name,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = usage.model_dump() if usage else None
            return body

        async def events() -> AsyncIterator[dict[str, Any]]:
            trackers: dict[int, Tracker] = {}
            if first_choices:
                yield chunk(first_choices)
            async for i, output in self.merged(streams):
                choices = []
                for c in output.outputs:
                    index = i * params.n + c.index
                    choice = make_choice(i, index, c, trackers.setdefault(index, Tracker()))
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage(prompts, sum(t.num_tokens for t in trackers.values())))

        return sse_response(events(), on_close=lambda: self.abort(streams))


def holdback(params: SamplingParams) -> int:
    """Characters a stream keeps back: one less than the longest stop string."""
    return max((len(s) for s in params.stop_list), default=1) - 1


def usage(prompts: list[Prompt], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
