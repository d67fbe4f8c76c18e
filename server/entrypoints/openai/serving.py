"""What every OpenAI endpoint shares: checks, sampling parameters, starting requests and collecting their outputs.

:mod:`serving_completion` and :mod:`serving_chat` build on :class:`OpenAIServing`; the
differences between the two endpoints (prompt shape, choice shape) are passed in, so
their streams run through one implementation (:func:`.streaming.stream`, in
:mod:`pagedllm.server.entrypoints.openai.streaming`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedllm.server.config import ConfigError
from pagedllm.server.engine.async_engine import AsyncLLMEngine
from pagedllm.server.engine.input_processor import check_token_ids
from pagedllm.server.engine.model_info import ModelInfo
from pagedllm.server.engine.request_stream import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.server.entrypoints.openai.errors import (
    APIError,
    bad_request,
    from_config_error,
    internal_error,
    unavailable,
)
from pagedllm.server.entrypoints.openai.guided import guided_decoding, logit_bias
from pagedllm.server.entrypoints.openai.protocol import (
    CompletionTokensDetails,
    PromptInput,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
)
from pagedllm.server.entrypoints.openai.serving_lora import LoRAModules
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.outputs import EngineOutput, RequestOutput
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import SamplingParams

_T = TypeVar("_T")
_Output = TypeVar("_Output", bound=EngineOutput)


access_log = logging.getLogger("pagedllm.access")


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass(frozen=True)
class RequestContext:
    """What an endpoint knows of the HTTP request besides its body."""

    request_id: str | None = None
    """The client's ``X-Request-Id``, if it sent one."""
    bearer_token: str | None = None
    """The caller's API key as presented (``Authorization: Bearer``)."""


@dataclass
class OpenAIServing:
    """The engine as the OpenAI endpoints use it."""

    engine: AsyncLLMEngine
    served_model_names: list[str]
    chat_template: str | None = None
    max_queue_len: int | None = None
    cache_salt_policy: str = "optional"
    request_timeout: float | None = None
    on_reject: Callable[[str], None] | None = None
    """Called with the reason when a request is turned away (the rejection counter)."""
    log_requests: bool = True
    """One access-log line per finished request (``--disable-log-requests`` turns it off)."""
    draining: bool = False
    loras: LoRAModules = field(default_factory=LoRAModules)
    """The LoRA adapters served, by the name a request gives as ``model``."""
    on_lora_request: Callable[[str], None] | None = None
    """Called with the adapter's name for each request that runs with one (the per-adapter counter)."""
    tool_call_parser: str | None = None
    """The format ``tool_choice="auto"`` reads calls in (``--tool-call-parser``); None: Hermes and LLaMA-3 JSON."""
    reasoning_parser: str | None = None
    """How the model marks its reasoning (``--reasoning-parser``); None: the whole text is content."""
    _serials: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)

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
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a name this server does not serve."""
        if model is None or model in self.served_model_names:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist: this server serves {self.served_model_names + self.loras.names}",
                param="model",
                code="model_not_found",
            )
        return lora

    def check_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down: retry on another replica")
        if not self.engine.is_ready:
            raise unavailable(f"the server is not ready: {self.engine.not_ready_reason()}")

    def check_queue(self, num_new: int) -> None:
        waiting = self.engine.num_unscheduled
        if self.max_queue_len is not None and waiting + num_new > self.max_queue_len:
            if self.on_reject is not None:
                self.on_reject("queue_full")
            raise unavailable(
                f"the waiting queue is full ({waiting} waiting, --max-waiting-requests={self.max_queue_len}): "
                "retry later"
            )

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer (--skip-tokenizer-init): send token ids")
        return self.tokenizer

    def prompts(self, value: PromptInput, param: str) -> list[Prompt]:
        """A string, a list of strings, a list of token ids or a list of such lists (request parameter ``param``)."""
        items: list[str | list[int]]
        if isinstance(value, str):
            items = [value]
        elif value and all(isinstance(p, int) for p in value):
            items = [[int(p) for p in value]]  # type: ignore[arg-type]
        else:
            items = list(value)  # type: ignore[arg-type]
        if not items:
            raise bad_request(f"{param} is empty: give a string, strings, token ids or lists of token ids", param)
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(item, self.need_tokenizer().encode(item)))
            else:
                prompts.append(Prompt(None, list(item)))  # NOTE: ids are checked by the engine's input processor
        return prompts

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

    def cache_salt(self, given: str | None, context: RequestContext) -> str | None:
        """The salt a request's prefix-cache blocks are keyed with, by ``cache_salt_policy``."""
        if self.cache_salt_policy == "required" and given is None:
            raise bad_request("cache_salt is required by this server (--cache-salt-policy required)", "cache_salt")
        if self.cache_salt_policy == "api-key":
            tenant = hashlib.sha256((context.bearer_token or "").encode()).hexdigest()
            return f"api-key:{tenant}/{given or ''}"
        return given

    # -- sampling parameters ------------------------------------------------------------------------
    def sampling_params(
        self, req: SamplingFields, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`, the model's generation_config filling what it left unset."""
        guided, _ = guided_decoding(req)
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
            logit_bias=logit_bias(req.logit_bias),
            guided_decoding=guided,
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
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams | PoolingParams,
        param_names: Mapping[str, str],
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Add one engine request per prompt; on any failure the ones added are aborted.

        ``request_id`` is the client's name for the request (``X-Request-Id`` or one made up);
        each engine request gets ``{request_id}-{serial}-{prompt index}``, the serial unique in
        this server, so two requests with the same ``X-Request-Id`` (a retry while the first
        still runs) never collide (the last two fields are numbers, so no other client id can
        end up spelling the same engine id). ``param_names`` maps engine fields to this request's
        parameter names for errors.
        """
        self.check_ready()
        self.check_queue(len(prompts))
        streams: list[RequestStream] = []
        now = time.monotonic()
        engine_id = f"{request_id}-{next(self._serials)}"
        try:
            for i, prompt in enumerate(prompts):
                engine_prompt = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids, "cache_salt": cache_salt}
                streams.append(
                    await self.engine.add_request(f"{engine_id}-{i}", engine_prompt, params, now, lora_request)
                )
        except ConfigError as exc:
            raise from_config_error(exc, param_names) from exc
        except EngineDeadError as exc:
            raise unavailable(str(exc)) from exc
        finally:
            if len(streams) < len(prompts):
                self.abort(streams)
        if lora_request is not None and self.on_lora_request is not None:
            self.on_lora_request(lora_request.lora_name)
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.abort(stream.request_id)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Each generation request's finished output."""
        return await self.finished(streams, RequestOutput)

    async def finished(self, streams: list[RequestStream], kind: type[_Output]) -> list[_Output]:
        """Each stream's finished output (``kind``: what its requests produce); aborts them all on any failure."""

        async def last(stream: RequestStream) -> _Output:
            output = None
            async for latest in self.engine.iterate(stream):
                output = latest
            assert isinstance(output, kind), "a stream ends with a finished output or an error"
            return output

        try:
            return list(await asyncio.wait_for(asyncio.gather(*(last(s) for s in streams)), self.request_timeout))
        except asyncio.TimeoutError as exc:
            raise self.timed_out() from exc
        except EngineDeadError as exc:
            raise unavailable(str(exc)) from exc
        except RequestFailedError as exc:
            raise internal_error(str(exc)) from exc
        finally:
            self.abort(streams)

    def log_access(
        self, request_id: str, prompts: list[Prompt], output_tokens: int, started: float, status: int = 200
    ) -> None:
        if self.log_requests:
            access_log.info(
                "%s %d prompt_tokens=%d output_tokens=%d %.3fs",
                request_id,
                status,
                sum(len(p.token_ids) for p in prompts),
                output_tokens,
                time.monotonic() - started,
            )

    def timed_out(self) -> APIError:
        return APIError(
            504,
            f"the request ran longer than --request-timeout={self.request_timeout:g}s and was aborted",
            type="timeout_error",
        )


def usage(
    prompts: list[Prompt], completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
) -> UsageInfo:
    """Token counts as OpenAI reports them; ``cached_tokens``: prompt tokens the prefix cache served;
    ``reasoning_tokens``: completion tokens spent on reasoning (None: not told apart)."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=None
        if reasoning_tokens is None
        else CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )


def cached_prompt_tokens(outputs: Iterable[RequestOutput]) -> int:
    """Prompt tokens the prefix cache served, over one output per engine request."""
    return sum(o.num_cached_tokens or 0 for o in outputs)
