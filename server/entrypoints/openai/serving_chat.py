"""``POST /v1/chat/completions``: messages through the chat template, chat-shaped choices and deltas."""

from __future__ import annotations

import dataclasses
import inspect
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.server.engine.request_stream import RequestStream
from pagedllm.server.entrypoints.openai import tool_calls
from pagedllm.server.entrypoints.openai.chat_messages import template_message
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
from pagedllm.server.entrypoints.openai.reasoning_parser import ReasoningFormat, count_tokens, reasoning_format
from pagedllm.server.entrypoints.openai.serving import (
    OpenAIServing,
    Prompt,
    RequestContext,
    cached_prompt_tokens,
    usage,
)
from pagedllm.server.entrypoints.openai.sse import SSEResponse
from pagedllm.server.entrypoints.openai.streaming import Delta, Tracker, holdback, stream
from pagedllm.server.entrypoints.openai.tool_call_writer import ToolCall
from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan
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
    reasoning: ReasoningFormat | None = None
    """How the model marks its reasoning (``--reasoning-parser``); None: the whole text is the answer."""
    keeps_special_tokens: bool = False
    """Special tokens were kept in the text for the tool-call format's markers (not for the request)."""


@dataclass(frozen=True)
class Answer:
    """A finished choice's text, its reasoning apart."""

    reasoning: str | None
    text: str
    reasoning_tokens: int
    reasoning_closed: bool = False
    """The model closed its reasoning (its end tag was read)."""


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
                self._choice_maker(req, holdback(params), run),
                first_choices=role,
            )
        (output,) = await serving.final_outputs(streams)
        formatter = LogprobFormatter(serving.tokenizer)
        choices = []
        reasoning_tokens = 0
        for raw in output.outputs:
            c = self.visible(run, raw)
            answer = self.answer(run, c)
            reasoning_tokens += answer.reasoning_tokens
            content, calls = parse_tool_calls(tools, c, answer.text)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        content=content or None if run.reasoning is not None else content,
                        reasoning_content=answer.reasoning,
                        reasoning=answer.reasoning,
                        tool_calls=[t.openai() for t in calls] or None,
                    ),
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
            usage=usage(
                [prompt],
                completion_tokens,
                cached_prompt_tokens([output]),
                reasoning_tokens if serving.reasoning_parser is not None else None,
            ),
        )

    def visible(self, run: ChatRun, c: CompletionOutput) -> CompletionOutput:
        """``c`` as the client sees it. NOTE: with special tokens kept for a tool-call format's markers,
        the text of the end-of-sequence (or stop) token that finished the choice is dropped again."""
        if not run.keeps_special_tokens or c.finish_reason != "stop" or isinstance(c.stop_reason, str):
            return c
        if not c.token_ids or self.serving.tokenizer is None:
            return c
        tail = self.serving.tokenizer.decode(c.token_ids[-1:], skip_special_tokens=False)
        return dataclasses.replace(c, text=c.text.removesuffix(tail)) if tail else c

    def answer(self, run: ChatRun, c: CompletionOutput) -> Answer:
        """A finished choice's answer, its reasoning (and the tokens spent on it) apart."""
        if run.reasoning is None:
            return Answer(None, c.text, 0)
        parser = run.reasoning.parser(run.prompt.text)
        parser.feed(c.text, final=True)
        spent = count_tokens(self.serving.tokenizer, c.token_ids, parser.reasoning_chars())
        return Answer(parser.reasoning or None, parser.content, spent, parser.reasoning_end is not None)

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
        tools = tool_calls.plan(
            req.tools, req.tool_choice, req.parallel_tool_calls is not False, serving.tool_call_parser
        )
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
        reasoning = reasoning_format(serving.reasoning_parser)
        keeps_special_tokens = params.skip_special_tokens and (
            tools is not None and tools.needs_special_tokens or reasoning is not None and reasoning.needs_special_tokens
        )
        if keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)  # NOTE: the format's markers
        messages_param = renames.get("messages", "messages")
        prompt = self.prompt(req.messages, req.add_generation_prompt, tools, messages_param, template_kwargs(req))
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
        if reasoning is not None and params.guided_decoding is not None:
            # NOTE: the grammar constrains the answer; the reasoning before it is free text
            markers = reasoning.markers(prompt.text)
            params = dataclasses.replace(
                params, guided_decoding=dataclasses.replace(params.guided_decoding, reasoning=markers)
            )
        streams = await serving.start(request_id, [prompt], params, param_names, cache_salt, lora)
        return ChatRun(request_id, prompt, params, tools, streams, started, reasoning, keeps_special_tokens)

    def prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: ToolPlan | None = None,
        param: str = "messages",
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        text = self.render(
            messages, add_generation_prompt, tools.template_tools if tools else None, param, template_kwargs
        )
        return Prompt(text, self.serving.need_tokenizer().encode(text, add_special_tokens=False))

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        param: str = "messages",
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The messages as prompt text, through the server's or the tokenizer's chat template.

        ``param`` names the messages in errors (the request's own name for them);
        ``template_kwargs`` are the request's ``chat_template_kwargs``, extra variables of the template."""
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
        plain = [template_message(m) for m in messages]
        extra = template_kwargs or {}
        taken = sorted(_render_arguments(tokenizer) & set(extra))
        if taken:
            raise bad_request(
                f"chat_template_kwargs may not set {taken}: give them as the request's own fields",
                "chat_template_kwargs",
            )
        try:
            return tokenizer.apply_chat_template(
                plain,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                **extra,
            )
        except Exception as exc:  # noqa: BLE001 (jinja raises many kinds; all are the request's fault)
            raise bad_request(f"the chat template could not render these messages: {exc}", param) from exc

    def _choice_maker(self, req: ChatCompletionRequest, keep: int, run: ChatRun):
        formatter = LogprobFormatter(self.serving.tokenizer)
        with_logprobs = bool(req.logprobs)
        tools = run.tools
        reads_calls = tools is not None and tools.reads_calls

        def make(
            i: int, index: int, output: RequestOutput, c: CompletionOutput, tracker: Tracker
        ) -> list[dict[str, Any]] | None:
            c = self.visible(run, c)
            delta = tracker.advance(c, keep, with_logprobs)
            if delta is None:
                return None
            logprobs = None
            if with_logprobs and delta.token_end > delta.token_start:
                logprobs = formatter.chat(c, delta.token_start, delta.token_end, req.top_logprobs or 0)
            finish_reason = delta.finish_reason
            messages, text = self._reasoning_messages(run, c, delta, tracker)
            if reads_calls:
                assert tools is not None
                called, finish_reason = _tool_messages(tools, text, delta.finish_reason, tracker)
                messages += called
            else:
                messages += [{"content": text}] if text else []
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

    def _reasoning_messages(
        self, run: ChatRun, c: CompletionOutput, delta: Delta, tracker: Tracker
    ) -> tuple[list[dict[str, Any]], str]:
        """The reasoning deltas a choice's new text makes, and the answer's part of that text.

        NOTE: while the reasoning runs every token so far is counted as reasoning; the exact
        count is taken once, when it ends (``tracker.extra["reasoning_tokens"]``, for usage).
        """
        if run.reasoning is None:
            return [], delta.text
        parser = tracker.extra.get("reasoning")
        if parser is None:
            parser = tracker.extra["reasoning"] = run.reasoning.parser(run.prompt.text)
        split = parser.feed(delta.text, final=delta.finish_reason is not None)
        if parser.in_reasoning and delta.finish_reason is None:
            tracker.extra["reasoning_tokens"] = len(c.token_ids)
            tracker.extra["reasoning_counted"] = False  # NOTE: a later reasoning block (harmony) is counted again
        elif not tracker.extra.get("reasoning_counted"):
            chars = parser.reasoning_chars()
            tracker.extra["reasoning_tokens"] = count_tokens(self.serving.tokenizer, c.token_ids, chars)
            tracker.extra["reasoning_counted"] = parser.reasoning_end is not None or delta.finish_reason is not None
        messages = [{"reasoning_content": split.reasoning, "reasoning": split.reasoning}] if split.reasoning else []
        return messages, split.content


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template's extra variables: ``chat_template_kwargs``, and ``reasoning_effort`` (which they may set too)."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def _render_arguments(tokenizer: Any) -> set[str]:
    """``apply_chat_template``'s own arguments (``tokenize``, ``return_dict``, ...): ``chat_template_kwargs``
    are the template's variables and may not set them."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {"messages", *(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD)}


def _tool_messages(
    tools: ToolPlan, text: str, finish_reason: str | None, tracker: Tracker
) -> tuple[list[dict[str, Any]], str | None]:
    """The deltas a choice's new answer text makes when read for tool calls, and its finish reason."""
    parser = tracker.extra.get("tools")
    if parser is None:
        parser = tracker.extra["tools"] = tools.parser()
    messages = parser.feed(text) + (parser.finish() if finish_reason else [])
    called = parser.calls and finish_reason == "stop"
    return messages, "tool_calls" if called else finish_reason


def parse_tool_calls(
    tools: ToolPlan | None, c: CompletionOutput, text: str | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished choice; a choice cut off by its token limit is text only.

    ``text``: the answer, when reasoning came before it (default: the choice's whole text)."""
    text = c.text if text is None else text
    if tools is None or c.finish_reason != "stop":
        return text, []
    return tools.parse(text)


def holds_tool_call(tools: ToolPlan) -> bool:
    """Whether an endpoint that sends calls whole keeps a choice's answer back until it ends.

    NOTE: any text may still turn into a call while tools are read, so all of it is held;
    chat streams calls as fragments instead (:func:`_tool_messages`).
    """
    return tools.reads_calls
