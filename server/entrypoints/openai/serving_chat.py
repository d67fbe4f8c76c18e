"""``POST /v1/chat/completions``: messages through the chat template, chat-shaped choices and deltas."""

from __future__ import annotations

import uuid
from typing import Any

from pagedllm.server.entrypoints.openai.errors import bad_request
from pagedllm.server.entrypoints.openai.guided import guided_param_names
from pagedllm.server.entrypoints.openai.logprobs import LogprobFormatter
from pagedllm.server.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
)
from pagedllm.server.entrypoints.openai.serving import OpenAIServing, Prompt, RequestContext, usage
from pagedllm.server.entrypoints.openai.sse import SSEResponse
from pagedllm.server.entrypoints.openai.streaming import Tracker, holdback, stream
from pagedllm.server.outputs import CompletionOutput


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(
        self, req: ChatCompletionRequest, context: RequestContext = RequestContext()
    ) -> ChatCompletionResponse | SSEResponse:
        serving = self.serving
        serving.check_model(req.model)
        serving.check_ready()
        self._check_unsupported(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = serving.sampling_params(
            req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None
        )
        prompt = self.prompt(req.messages, req.add_generation_prompt)
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        serving.check_length(prompt, max_tokens, max_tokens_param)
        request_id = context.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        cache_salt = serving.cache_salt(req.cache_salt, context)
        param_names = {
            "prompt": "messages",
            "prompt_token_ids": "messages",
            "logprobs": "top_logprobs",
            "max_tokens": max_tokens_param,
            **guided_param_names(req),
            **({} if req.best_of is not None else {"best_of": "n"}),
        }
        streams = await serving.start(request_id, [prompt], params, param_names, cache_salt)
        if req.stream:
            role = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(params.n)
            ]
            return stream(
                serving,
                request_id,
                "chat.completion.chunk",
                [prompt],
                params,
                streams,
                req.stream_options,
                self._choice_maker(req, holdback(params)),
                first_choices=role,
            )
        (output,) = await serving.final_outputs(streams)
        formatter = LogprobFormatter(serving.tokenizer)
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=formatter.chat(c, 0, len(c.token_ids), req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in output.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=serving.model_name,
            choices=choices,
            usage=usage([prompt], sum(len(c.token_ids) for c in output.outputs)),
        )

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if req.tools:
            raise bad_request("tools are not supported by this server", "tools")

    def prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> Prompt:
        text = self.render(messages, add_generation_prompt)
        return Prompt(text, self.serving.need_tokenizer().encode(text, add_special_tokens=False))

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        """The messages as prompt text, through the server's or the tokenizer's chat template."""
        tokenizer = self.serving.need_tokenizer()
        template = self.serving.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template: start the server with --chat-template FILE "
                "(a Jinja template) or use /v1/completions",
                "messages",
            )
        if not messages:
            raise bad_request("messages is empty: give at least one message", "messages")
        plain = [{"role": m.role, "content": _message_text(m)} for m in messages]
        try:
            return tokenizer.apply_chat_template(
                plain, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template
            )
        except Exception as exc:  # noqa: BLE001 (jinja raises many kinds; all are the request's fault)
            raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc

    def _choice_maker(self, req: ChatCompletionRequest, keep: int):
        formatter = LogprobFormatter(self.serving.tokenizer)
        with_logprobs = bool(req.logprobs)

        def make(i: int, index: int, c: CompletionOutput, tracker: Tracker) -> dict[str, Any] | None:
            delta = tracker.advance(c, keep, with_logprobs)
            if delta is None:
                return None
            logprobs = None
            if with_logprobs and delta.token_end > delta.token_start:
                logprobs = formatter.chat(c, delta.token_start, delta.token_end, req.top_logprobs or 0)
            return {
                "index": index,
                "delta": {"content": delta.text} if delta.text or not tracker.finished else {},
                "logprobs": logprobs.model_dump() if logprobs else None,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }

        return make


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
