"""``POST /v1/chat/completions``: messages through the chat template, chat-shaped choices and deltas."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.server.engine.request_stream import RequestStream
from pagedllm.server.entrypoints.openai import tool_calls
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
from pagedllm.server.entrypoints.openai.serving import (
    OpenAIServing,
    Prompt,
    RequestContext,
    cached_prompt_tokens,
    usage,
)
from pagedllm.server.entrypoints.openai.sse import SSEResponse
from pagedllm.server.entrypoints.openai.streaming import Delta, Tracker, holdback, stream
from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.server.entrypoints.openai.tool_parser import ToolCall, ToolCallParser
from pagedllm.server.outputs import CompletionOutput, RequestOutput
from pagedllm.server.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatRun:
    """A chat-shaped request, checked and added to the engine: what an endpoint then streams or collects."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    tools: ToolPlan | None
    streams: list[RequestStream]
    started: float
    """``time.monotonic()`` when the request came in (for the access log)."""


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(
        self, req: ChatCompletionRequest, context: RequestContext = RequestContext()
    ) -> ChatCompletionResponse | SSEResponse:
        serving = self.serving
        run = await self.start(req, context, context.request_id or f"chatcmpl-{uuid.uuid4().hex}")
        request_id, prompt, params, tools, streams = run.request_id, run.prompt, run.params, run.tools, run.streams
        if req.stream:
            # NOTE: a forced call has no text content, as a non-streamed reply says with null
            content = None if tools is not None and tools.mode in ("named", "required") else ""
            role = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": None,
                }
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
                self._choice_maker(req, holdback(params), tools),
                first_choices=role,
            )
        (output,) = await serving.final_outputs(streams)
        formatter = LogprobFormatter(serving.tokenizer)
        choices = []
        for c in output.outputs:
            content, calls = parse_tool_calls(tools, c)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=content, tool_calls=[t.openai() for t in calls] or None),
                    logprobs=formatter.chat(c, 0, len(c.token_ids), req.top_logprobs or 0) if req.logprobs else None,
                    finish_reason="tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        serving.log_access(request_id, [prompt], completion_tokens, run.started)
        return ChatCompletionResponse(
            id=request_id,
            model=serving.model_name,
            choices=choices,
            usage=usage([prompt], completion_tokens, cached_prompt_tokens([output])),
        )

    async def start(
        self, req: ChatCompletionRequest, context: RequestContext, request_id: str, renames: Mapping[str, str] = {}
    ) -> ChatRun:
        """Check a chat-shaped request, render its prompt and add it to the engine.

        ``renames`` maps chat's parameter names to the calling endpoint's, for its errors
        (the Responses API says ``input`` where chat says ``messages``).
        """
        serving = self.serving
        started = time.monotonic()
        lora = serving.check_model(req.model)
        serving.check_ready()
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        tools = tool_calls.plan(req.tools, req.tool_choice, parallel=req.parallel_tool_calls is not False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = serving.sampling_params(
            req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None
        )
        if tools is not None and tools.guided() is not None:
            if params.guided_decoding is not None:
                raise bad_request(
                    "tool_choice required or a named function already constrains the output: "
                    f"drop {renames.get('response_format', 'response_format / guided_*')}",
                    "tool_choice",
                )
            params = dataclasses.replace(params, guided_decoding=tools.guided())
        messages_param = renames.get("messages", "messages")
        prompt = self.prompt(req.messages, req.add_generation_prompt, tools, messages_param)
        max_tokens_param = renames.get("max_tokens") or (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        serving.check_length(prompt, max_tokens, max_tokens_param)
        cache_salt = serving.cache_salt(req.cache_salt, context)
        param_names = {
            "prompt": messages_param,
            "prompt_token_ids": messages_param,
            "logprobs": "top_logprobs",
            "max_tokens": max_tokens_param,
            **{field: renames.get(param, param) for field, param in guided_param_names(req).items()},
            **({} if req.best_of is not None else {"best_of": "n"}),
        }
        streams = await serving.start(request_id, [prompt], params, param_names, cache_salt, lora)
        return ChatRun(request_id, prompt, params, tools, streams, started)

    def prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: ToolPlan | None = None,
        param: str = "messages",
    ) -> Prompt:
        text = self.render(messages, add_generation_prompt, tools.template_tools if tools else None, param)
        return Prompt(text, self.serving.need_tokenizer().encode(text, add_special_tokens=False))

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        param: str = "messages",
    ) -> str:
        """The messages as prompt text, through the server's or the tokenizer's chat template.

        ``param`` names the messages in errors (the request's own name for them)."""
        tokenizer = self.serving.need_tokenizer()
        template = self.serving.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template: start the server with --chat-template FILE "
                "(a Jinja template) or use /v1/completions",
                param,
            )
        if not messages:
            raise bad_request(f"{param} is empty: give at least one message", param)
        plain = [_plain(m) for m in messages]
        try:
            return tokenizer.apply_chat_template(
                plain, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template
            )
        except Exception as exc:  # noqa: BLE001 (jinja raises many kinds; all are the request's fault)
            raise bad_request(f"the chat template could not render these messages: {exc}", param) from exc

    def _choice_maker(self, req: ChatCompletionRequest, keep: int, tools: ToolPlan | None):
        formatter = LogprobFormatter(self.serving.tokenizer)
        with_logprobs = bool(req.logprobs)
        reads_calls = tools is not None and tools.reads_calls

        def make(
            i: int, index: int, output: RequestOutput, c: CompletionOutput, tracker: Tracker
        ) -> list[dict[str, Any]] | None:
            delta = tracker.advance(c, keep, with_logprobs)
            if delta is None:
                return None
            logprobs = None
            if with_logprobs and delta.token_end > delta.token_start:
                logprobs = formatter.chat(c, delta.token_start, delta.token_end, req.top_logprobs or 0)
            finish_reason = delta.finish_reason
            if reads_calls:
                assert tools is not None
                messages, finish_reason = _tool_messages(tools, delta, tracker)
            else:
                messages = [{"content": delta.text}] if delta.text else []
            if not messages and (finish_reason or logprobs):
                messages = [{"content": ""} if not tracker.finished else {}]
            choices: list[dict[str, Any]] = [
                {"index": index, "delta": m, "logprobs": None, "finish_reason": None, "stop_reason": None}
                for m in messages
            ]
            if choices:
                choices[0]["logprobs"] = logprobs.model_dump() if logprobs else None
                choices[-1].update(finish_reason=finish_reason, stop_reason=delta.stop_reason)
            return choices

        return make


def _tool_messages(tools: ToolPlan, delta: Delta, tracker: Tracker) -> tuple[list[dict[str, Any]], str | None]:
    """The deltas a choice's new text makes when read for tool calls, and its finish reason."""
    parser = tracker.extra.get("tools")
    if parser is None:
        parser = tracker.extra["tools"] = ToolCallParser(tools)
    messages = parser.feed(delta.text) + (parser.finish() if delta.finish_reason else [])
    called = parser.calls and delta.finish_reason == "stop"
    return messages, "tool_calls" if called else delta.finish_reason


def parse_tool_calls(tools: ToolPlan | None, c: CompletionOutput) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished choice; a choice cut off by its token limit is text only."""
    if tools is None or c.finish_reason != "stop":
        return c.text, []
    return tools.parse(c.text)


def holds_tool_call(tools: ToolPlan, c: CompletionOutput, tracker: Tracker) -> bool:
    """Whether an endpoint that sends calls whole keeps this choice's text back until it ends.

    NOTE: any text may still turn into a call while tools are read, so all of it is held;
    chat streams calls as fragments instead (:func:`_tool_messages`).
    """
    return tools.reads_calls


def _plain(message: ChatMessage) -> dict[str, Any]:
    plain: dict[str, Any] = {"role": message.role, "content": _message_text(message)}
    if message.tool_calls:
        plain["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.tool_call_id:
        plain["tool_call_id"] = message.tool_call_id
    if message.name:
        plain["name"] = message.name
    return plain


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool call, with its arguments as an object (what chat templates expect)."""
    function = dict(call.get("function") or {})
    try:
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        pass
    return {**call, "function": function}


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
