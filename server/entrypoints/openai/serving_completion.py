"""``POST /v1/completions``: prompts in any of OpenAI's four shapes, echo, logprobs, streaming."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagedllm.server.entrypoints.openai.errors import bad_request
from pagedllm.server.entrypoints.openai.guided import guided_param_names
from pagedllm.server.entrypoints.openai.logprobs import LogprobFormatter
from pagedllm.server.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedllm.server.entrypoints.openai.serving import (
    OpenAIServing,
    Prompt,
    RequestContext,
    cached_prompt_tokens,
    usage,
)
from pagedllm.server.entrypoints.openai.sse import SSEResponse
from pagedllm.server.entrypoints.openai.streaming import Tracker, holdback, stream
from pagedllm.server.outputs import CompletionOutput, RequestOutput
from pagedllm.server.sampling_params import SamplingParams


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(
        self, req: CompletionRequest, context: RequestContext = RequestContext()
    ) -> CompletionResponse | SSEResponse:
        serving = self.serving
        started = time.monotonic()
        lora = serving.check_model(req.model)
        serving.check_ready()
        logprobs = req.logprobs
        params = serving.sampling_params(
            req,
            max_tokens=req.max_tokens,
            logprobs=logprobs,
            prompt_logprobs=logprobs if req.echo and logprobs is not None else None,
        )
        if req.suffix:
            raise bad_request("suffix is not supported by this server: leave it null", "suffix")
        prompts = serving.prompts(req.prompt, "prompt")
        for prompt in prompts:
            serving.check_length(prompt, req.max_tokens, "max_tokens")
        request_id = context.request_id or f"cmpl-{uuid.uuid4().hex}"
        cache_salt = serving.cache_salt(req.cache_salt, context)
        param_names = {**guided_param_names(req), **({} if req.best_of is not None else {"best_of": "n"})}
        streams = await serving.start(request_id, prompts, params, param_names, cache_salt, lora)
        if req.stream:
            return stream(
                serving,
                request_id,
                "text_completion",
                prompts,
                params,
                streams,
                req.stream_options,
                self._choice_maker(req, prompts, params),
            )
        outputs = await serving.final_outputs(streams)
        response = self._response(request_id, req, prompts, params, outputs)
        serving.log_access(request_id, prompts, sum(len(c.token_ids) for o in outputs for c in o.outputs), started)
        return response

    def _formatter(self) -> LogprobFormatter:
        return LogprobFormatter(self.serving.tokenizer)

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        tokenizer = self.serving.tokenizer
        return tokenizer.decode(prompt.token_ids) if tokenizer is not None else ""

    def _response(
        self,
        request_id: str,
        req: CompletionRequest,
        prompts: list[Prompt],
        params: SamplingParams,
        outputs: list[RequestOutput],
    ) -> CompletionResponse:
        formatter = self._formatter()
        choices, completion_tokens = [], 0
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            prompt_text = self._prompt_text(prompt) if req.echo else ""
            for c in output.outputs:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offset = formatter.add_prompt(logprobs, output) if req.echo else 0
                    formatter.add_completion(logprobs, c, 0, len(c.token_ids), offset)
                choices.append(
                    CompletionChoice(
                        index=i * params.n + c.index,
                        text=prompt_text + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
                completion_tokens += len(c.token_ids)
        return CompletionResponse(
            id=request_id,
            model=self.serving.model_name,
            choices=choices,
            usage=usage(prompts, completion_tokens, cached_prompt_tokens(outputs)),
        )

    def _choice_maker(self, req: CompletionRequest, prompts: list[Prompt], params: SamplingParams):
        formatter = self._formatter()
        keep = holdback(params)
        with_logprobs = req.logprobs is not None

        def make(
            i: int, index: int, output: RequestOutput, c: CompletionOutput, tracker: Tracker
        ) -> dict[str, Any] | None:
            delta = tracker.advance(c, keep, with_logprobs)
            if delta is None:
                return None
            echo_now = req.echo and not tracker.extra.get("echo_sent")
            prefix = self._prompt_text(prompts[i]) if echo_now else ""
            tracker.extra["echo_sent"] = tracker.extra.get("echo_sent") or echo_now
            logprobs = None
            if with_logprobs and (echo_now or delta.token_end > delta.token_start):
                logprobs = CompletionLogprobs()
                if echo_now:  # NOTE: the echoed prompt's logprobs lead the first chunk, as in a non-streamed reply
                    tracker.extra["offset"] = formatter.add_prompt(logprobs, output)
                tracker.extra["offset"] = formatter.add_completion(
                    logprobs, c, delta.token_start, delta.token_end, tracker.extra.get("offset", 0)
                )
            return {
                "index": index,
                "text": prefix + delta.text,
                "logprobs": logprobs.model_dump() if logprobs else None,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }

        return make
