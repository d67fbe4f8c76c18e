"""The OpenAI endpoints' logic: requests -> prompts and sampling parameters -> engine -> responses.

The HTTP wiring (routes, auth, errors, health) lives in :mod:`pagedllm.server.api_server`;
this module knows nothing about FastAPI beyond the streaming response it returns.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Union

from pagedllm.server.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from pagedllm.server.outputs import CompletionOutput, RequestOutput
from pagedllm.server.protocol import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage, ChatResponseMessage,
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, SamplingFields, TokenLogprob,
    TopLogprob, UsageInfo,
)
from pagedllm.server.sampling_params import SamplingParams

RETRY_AFTER_S = 1
MIN_REPETITION_PENALTY = 1e-6


class APIError(Exception):
    """An error the client sees in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def _param_of(message: str) -> Optional[str]:
    """The field a ``ValueError`` names: ``"top_p=2 is invalid..."`` -> ``"top_p"``."""
    head = message.split("=", 1)[0]
    return head if head.isidentifier() else None


@dataclass
class Prompt:
    text: Optional[str]
    token_ids: list[int]


@dataclass
class Tracker:
    """What one choice already sent to a streaming client."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    finished: bool = False
    echo_sent: bool = False


@dataclass
class OpenAIServing:
    """Serves the completion, chat and tokenizer endpoints over one async engine."""

    engine: AsyncLLMEngine
    served_model_names: list[str]
    chat_template: Optional[str] = None
    max_queue_len: Optional[int] = None
    draining: bool = field(default=False)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- checks shared by every endpoint ------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist: this server serves "
                                f"{self.served_model_names}", param="model", code="model_not_found")

    def check_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down: retry on another replica")
        if not self.engine.is_ready:
            raise unavailable(f"the server is not ready: {self.engine.not_ready_reason()}")

    def check_queue(self, num_new: int) -> None:
        waiting = self.engine.num_unscheduled
        if self.max_queue_len is not None and waiting + num_new > self.max_queue_len:
            raise unavailable(f"the waiting queue is full ({waiting} waiting, --max-queue-len="
                              f"{self.max_queue_len}): retry later")

    def need_tokenizer(self):
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer (--skip-tokenizer-init): send token ids")
        return self.tokenizer

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.model_info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param} contain {bad[:3]}: token ids must be integers in [0, {vocab})", param)

    # -- sampling parameters --------------------------------------------------------------------
    def sampling_params(self, req: SamplingFields, *, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        self._check_unsupported(req)
        values = dict(n=req.n, best_of=req.best_of, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, min_p=req.min_p, presence_penalty=req.presence_penalty,
                      frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                      seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                      max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                      include_stop_str_in_output=req.include_stop_str_in_output,
                      use_beam_search=req.use_beam_search, length_penalty=req.length_penalty)
        for key, value in self.engine.model_info.default_sampling.items():
            if values.get(key) is None:
                values[key] = value  # NOTE: the model's generation_config fills what the request left unset
        values = {k: v for k, v in values.items() if v is not None or k in ("max_tokens", "logprobs")}
        if values.get("top_k", 0) > self.engine.model_info.vocab_size:
            values["top_k"] = self.engine.model_info.vocab_size  # NOTE: same distribution, keeps all tokens
        try:
            params = SamplingParams(**values)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), _param_of(str(exc))) from exc
        self._check_limits(req, params)
        return params

    @staticmethod
    def _check_unsupported(req: SamplingFields) -> None:
        if req.logit_bias:
            raise bad_request("logit_bias is not supported by this server: leave it empty", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options can only be set when stream=true", "stream_options")

    def _check_limits(self, req: SamplingFields, params: SamplingParams) -> None:
        max_seqs = self.engine.config.scheduler.max_num_seqs
        if params.best_of > max_seqs:
            name = "best_of" if req.best_of is not None else "n"
            raise bad_request(f"{name}={params.best_of} is too large: at most max_num_seqs={max_seqs} "
                              "sequences run at once", name)
        if req.stream and params.best_of > params.n:
            raise bad_request(f"best_of={params.best_of} must equal n={params.n} when streaming", "best_of")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.repetition_penalty < MIN_REPETITION_PENALTY:
            # NOTE: the sampler divides logits by it; tinier values overflow to inf and crash the step.
            raise bad_request(f"repetition_penalty={params.repetition_penalty!r} is too small: must be >= "
                              f"{MIN_REPETITION_PENALTY} (and <= 2)", "repetition_penalty")

    def check_length(self, prompt: Prompt, max_tokens: Optional[int], param: str) -> None:
        limit = self.engine.model_info.max_model_len
        n = len(prompt.token_ids)
        if max_tokens is not None and n < limit < n + max_tokens:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). "
                              f"Please reduce the prompt or {param}.", param)

    # -- prompts ------------------------------------------------------------------------------
    def completion_prompts(self, prompt) -> list[Prompt]:
        """A string, a list of strings, a list of token ids or a list of such lists."""
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt is empty: give a string, strings, token ids or lists of token ids", "prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(item, self.need_tokenizer().encode(item)))
            else:
                self.check_token_ids(item, "prompt")
                prompts.append(Prompt(None, list(item)))
        return prompts

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> Prompt:
        text = self.render_chat(messages, add_generation_prompt)
        return Prompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        tokenizer = self.need_tokenizer()
        if self.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: start the server with --chat-template FILE "
                              "(a Jinja template) or use /v1/completions", "messages")
        if not messages:
            raise bad_request("messages is empty: give at least one message", "messages")
        plain = [{"role": m.role, "content": _message_text(m)} for m in messages]
        try:
            return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 chat_template=self.chat_template)
        except Exception as exc:  # noqa: BLE001 (jinja raises many kinds; all are the request's fault)
            raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc

    # -- running requests -------------------------------------------------------------------------
    async def start(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> list[RequestStream]:
        """Add one engine request per prompt; on any failure the ones added are aborted."""
        self.check_ready()
        self.check_queue(len(prompts))
        streams: list[RequestStream] = []
        now = time.monotonic()
        try:
            for i, prompt in enumerate(prompts):
                engine_prompt = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                streams.append(await self.engine.add_request(f"{request_id}-{i}", engine_prompt, params, now))
        except ValueError as exc:
            raise bad_request(str(exc), _param_of(str(exc)) or "prompt") from exc
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
            async for output in self.engine.iterate(stream):
                pass
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
        queue: asyncio.Queue = asyncio.Queue()

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
                i, output, error = await queue.get()
                if error is not None:
                    raise error
                if output is None:
                    remaining -= 1
                else:
                    yield i, output
        finally:
            for task in tasks:
                task.cancel()
            self.abort(streams)

    # -- /v1/completions ---------------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest):
        self.check_model(req.model)
        self.check_ready()
        logprobs = req.logprobs
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=logprobs,
                                      prompt_logprobs=logprobs if req.echo and logprobs is not None else None)
        if req.suffix:
            raise bad_request("suffix is not supported by this server: leave it null", "suffix")
        prompts = self.completion_prompts(req.prompt)
        for prompt in prompts:
            self.check_length(prompt, req.max_tokens, "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start(request_id, prompts, params)
        if req.stream:
            return self._completion_stream(request_id, req, prompts, params, streams)
        outputs = await self.final_outputs(streams)
        return self._completion_response(request_id, req, prompts, params, outputs)

    def _completion_response(self, request_id: str, req: CompletionRequest, prompts: list[Prompt],
                             params: SamplingParams, outputs: list[RequestOutput]) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            prompt_text = self._prompt_text(prompt) if req.echo else ""
            for c in output.outputs:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offset = self._add_prompt_logprobs(logprobs, output) if req.echo else 0
                    self._add_completion_logprobs(logprobs, c, 0, len(c.token_ids), offset)
                choices.append(CompletionChoice(index=i * params.n + c.index, text=prompt_text + c.text,
                                                logprobs=logprobs, finish_reason=_finish(c),
                                                stop_reason=c.stop_reason))
                completion_tokens += len(c.token_ids)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=_usage(prompts, completion_tokens))

    def _completion_stream(self, request_id: str, req: CompletionRequest, prompts: list[Prompt],
                           params: SamplingParams, streams: list[RequestStream]):
        created = int(time.time())
        holdback = max((len(s) for s in params.stop_list), default=1) - 1
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage: Optional[UsageInfo] = None) -> dict:
            body = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage.model_dump() if usage else None
            return body

        async def events() -> AsyncIterator[dict]:
            trackers: dict[int, Tracker] = {}
            async for i, output in self.merged(streams):
                choices = []
                for c in output.outputs:
                    index = i * params.n + c.index
                    tracker = trackers.setdefault(index, Tracker())
                    prefix = ""
                    if req.echo and not tracker.echo_sent:
                        prefix, tracker.echo_sent = self._prompt_text(prompts[i]), True
                    choice = self._completion_delta(req, c, tracker, holdback, prefix, index)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield chunk(choices)
            if include_usage:
                completion_tokens = sum(t.num_tokens for t in trackers.values())
                yield chunk([], _usage(prompts, completion_tokens))

        return self.sse(events(), streams)

    def _completion_delta(self, req: CompletionRequest, c: CompletionOutput, tracker: Tracker, holdback: int,
                          prefix: str, index: int) -> Optional[dict]:
        if tracker.finished:
            return None
        end = len(c.text) if c.finish_reason else max(tracker.text_len, len(c.text) - holdback)
        text = prefix + c.text[tracker.text_len:end]
        logprobs = None
        if req.logprobs is not None and len(c.token_ids) > tracker.num_tokens:
            logprobs = CompletionLogprobs()
            tracker.text_offset = self._add_completion_logprobs(logprobs, c, tracker.num_tokens, len(c.token_ids),
                                                                tracker.text_offset)
        if not text and logprobs is None and not c.finish_reason:
            return None
        tracker.text_len, tracker.num_tokens = end, len(c.token_ids)
        tracker.finished = c.finish_reason is not None
        return {"index": index, "text": text, "logprobs": logprobs.model_dump() if logprobs else None,
                "finish_reason": _finish(c), "stop_reason": c.stop_reason}

    # -- logprobs ----------------------------------------------------------------------------------
    def _token_text(self, token_id: int, entry=None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _add_completion_logprobs(self, out: CompletionLogprobs, c: CompletionOutput, start: int, end: int,
                                 offset: int) -> int:
        entries = c.logprobs or []
        for j in range(start, min(end, len(entries))):
            token_id, top = c.token_ids[j], entries[j]
            token = self._token_text(token_id, top.get(token_id))
            out.tokens.append(token)
            out.token_logprobs.append(top[token_id].logprob if token_id in top else None)
            out.top_logprobs.append({self._token_text(t, lp): lp.logprob for t, lp in top.items()})
            out.text_offset.append(offset)
            offset += len(token)
        return offset

    def _add_prompt_logprobs(self, out: CompletionLogprobs, output: RequestOutput) -> int:
        entries = output.prompt_logprobs or []
        offset = 0
        for j, token_id in enumerate(output.prompt_token_ids):
            top = entries[j] if j < len(entries) else None
            token = self._token_text(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(top[token_id].logprob if top and token_id in top else None)
            out.top_logprobs.append({self._token_text(t): lp.logprob for t, lp in top.items()} if top else None)
            out.text_offset.append(offset)
            offset += len(token)
        return offset

    def _chat_logprobs(self, c: CompletionOutput, start: int, end: int, num_top: int) -> ChatLogprobs:
        content = []
        entries = c.logprobs or []
        for j in range(start, min(end, len(entries))):
            token_id, top = c.token_ids[j], entries[j]
            token = self._token_text(token_id, top.get(token_id))
            ranked = sorted(top.items(), key=lambda kv: kv[1].rank or 0)[:num_top]
            content.append(TokenLogprob(
                token=token, logprob=top[token_id].logprob if token_id in top else float("-inf"),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[TopLogprob(token=(s := self._token_text(t, lp)), logprob=lp.logprob,
                                         bytes=list(s.encode("utf-8"))) for t, lp in ranked]))
        return ChatLogprobs(content=content)

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    # -- /v1/chat/completions --------------------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        self.check_ready()
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request(f"response_format={req.response_format!r} is not supported: only type 'text'",
                              "response_format")
        if req.tools:
            raise bad_request("tools are not supported by this server", "tools")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens=max_tokens,
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        prompt = self.chat_prompt(req.messages, req.add_generation_prompt)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self.check_length(prompt, max_tokens, param)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(request_id, [prompt], params)
        if req.stream:
            return self._chat_stream(request_id, req, prompt, params, streams)
        (output,) = await self.final_outputs(streams)
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._chat_logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0)
                              if req.logprobs else None,
                              finish_reason=_finish(c), stop_reason=c.stop_reason)
                   for c in output.outputs]
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=_usage([prompt], sum(len(c.token_ids) for c in output.outputs)))

    def _chat_stream(self, request_id: str, req: ChatCompletionRequest, prompt: Prompt, params: SamplingParams,
                     streams: list[RequestStream]):
        created = int(time.time())
        holdback = max((len(s) for s in params.stop_list), default=1) - 1
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage: Optional[UsageInfo] = None) -> dict:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage.model_dump() if usage else None
            return body

        async def events() -> AsyncIterator[dict]:
            trackers = {i: Tracker() for i in range(params.n)}
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)])
            async for _, output in self.merged(streams):
                choices = [choice for c in output.outputs
                           if (choice := self._chat_delta(req, c, trackers[c.index], holdback)) is not None]
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], _usage([prompt], sum(t.num_tokens for t in trackers.values())))

        return self.sse(events(), streams)

    def _chat_delta(self, req: ChatCompletionRequest, c: CompletionOutput, tracker: Tracker,
                    holdback: int) -> Optional[dict]:
        if tracker.finished:
            return None
        end = len(c.text) if c.finish_reason else max(tracker.text_len, len(c.text) - holdback)
        text = c.text[tracker.text_len:end]
        new_tokens = len(c.token_ids) > tracker.num_tokens
        if not text and not new_tokens and not c.finish_reason:
            return None
        logprobs = None
        if req.logprobs and new_tokens:
            logprobs = self._chat_logprobs(c, tracker.num_tokens, len(c.token_ids), req.top_logprobs or 0)
        tracker.text_len, tracker.num_tokens = end, len(c.token_ids)
        tracker.finished = c.finish_reason is not None
        if not text and logprobs is None and not tracker.finished:
            return None
        return {"index": c.index, "delta": {"content": text} if text or not tracker.finished else {},
                "logprobs": logprobs.model_dump() if logprobs else None, "finish_reason": _finish(c),
                "stop_reason": c.stop_reason}

    # -- server-sent events ----------------------------------------------------------------------------
    def sse(self, events: AsyncIterator[dict], streams: list[RequestStream]):
        from pagedllm.server.api_server import SSEResponse

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
            except EngineDeadError as exc:
                error = unavailable(str(exc))
                yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"

        return SSEResponse(body(), on_close=lambda: self.abort(streams))


def _message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise bad_request(f"content part type={part.type!r} is not supported: only 'text'", "messages")
        parts.append(part.text or "")
    return "".join(parts)


def _finish(c: CompletionOutput) -> Optional[str]:
    return c.finish_reason


def _usage(prompts: list[Prompt], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

