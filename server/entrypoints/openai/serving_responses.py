"""``POST /v1/responses`` (OpenAI's Responses API) and ``GET /v1/responses/{id}``.

A Responses request is a chat completion in another shape: the stored conversation of
``previous_response_id`` and the request's input items become chat messages (after
``instructions``, as a system message), ``text.format`` the response format and the flat
function tools chat's tools; :meth:`OpenAIServingChat.start` then checks, renders and
runs it. What differs is the answer: output items (a message, function calls) and, when
streamed, the Responses API's named events, numbered by ``sequence_number``::

    response.created, response.in_progress
    per output item:  response.output_item.added
        a message:       response.content_part.added, response.output_text.delta (many),
                         response.output_text.done, response.content_part.done
        a function call: response.function_call_arguments.delta, ...arguments.done
                      response.output_item.done
    response.completed  (response.incomplete when max_output_tokens cut it short)

With ``--reasoning-parser`` the model's reasoning is a ``reasoning`` item before the answer's
items (``response.content_part.added``, ``response.reasoning_text.delta`` as it is written,
``response.reasoning_text.done``, ``response.content_part.done``); the answer is read for tool
calls as in chat.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import TypeAdapter

from pagedllm.server.entrypoints.openai.errors import APIError, bad_request
from pagedllm.server.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.server.entrypoints.openai.protocol_responses import (
    FunctionCall,
    FunctionCallInput,
    FunctionToolChoice,
    IncompleteDetails,
    InputItem,
    InputMessage,
    InputText,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningInput,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    TextConfig,
)
from pagedllm.server.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.server.entrypoints.openai.responses_events import (
    EventCounter,
    dump,
    item_done,
    item_whole,
    message_opened,
    part_opened,
    reasoning_delta,
    text_delta,
)
from pagedllm.server.entrypoints.openai.serving import OpenAIServing, RequestContext
from pagedllm.server.entrypoints.openai.serving_chat import (
    Answer,
    ChatRun,
    OpenAIServingChat,
    holds_tool_call,
    parse_tool_calls,
)
from pagedllm.server.entrypoints.openai.sse import SSEResponse, sse_response
from pagedllm.server.entrypoints.openai.streaming import Tracker, holdback, merged, until_timeout
from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.server.outputs import CompletionOutput

RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
"""Chat's parameter names -> this endpoint's, for the errors :meth:`OpenAIServingChat.start` raises."""
INPUT_ITEM: TypeAdapter[InputItem] = TypeAdapter(InputItem)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    @property
    def serving(self) -> OpenAIServing:
        return self.chat.serving

    async def create(
        self, req: ResponsesRequest, context: RequestContext = RequestContext()
    ) -> ResponsesResponse | SSEResponse:
        items = self._history(req.previous_response_id) + input_items(req.input)
        response_id = f"resp_{uuid.uuid4().hex}"
        chat_req = chat_request(req, chat_messages(req.instructions, items))
        run = await self.chat.start(chat_req, context, context.request_id or response_id, RENAMES)
        draft = self._draft(req, run, response_id)
        if req.stream:
            return self._stream(run, draft, items)
        (output,) = await self.serving.final_outputs(run.streams)
        c = self.chat.visible(run, output.outputs[0])
        answer = self.chat.answer(run, c)
        response = finish(draft, run, c, answer, ItemIds(), run.tools, output.num_cached_tokens or 0)
        self._remember(response, items)
        self.serving.log_access(run.request_id, [run.prompt], len(c.token_ids), run.started)
        return response

    def retrieve(self, response_id: str) -> ResponsesResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"Response with id {response_id!r} not found: {self._why_missing()}",
                param="response_id",
                code="response_not_found",
            )
        return stored.response

    # -- conversation --------------------------------------------------------------------------
    def _history(self, previous_response_id: str | None) -> list[InputItem]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise APIError(
                400,
                f"Previous response with id {previous_response_id!r} not found: {self._why_missing()}",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return list(stored.conversation)

    def _why_missing(self) -> str:
        return (
            "it was created with store=false, on another replica or before a restart, or it was evicted "
            f"(this server keeps the last {self.store.capacity}: --responses-store-size)"
        )

    def _remember(self, response: ResponsesResponse, items: list[InputItem]) -> None:
        if response.store:
            answer = [INPUT_ITEM.validate_python(dump(item)) for item in response.output]
            self.store.put(StoredResponse(response, items + answer))

    # -- the answer ----------------------------------------------------------------------------
    def _draft(self, req: ResponsesRequest, run: ChatRun, response_id: str) -> ResponsesResponse:
        """The response while it runs: the request's settings, no output yet."""
        return ResponsesResponse(
            id=response_id,
            status="in_progress",
            model=self.serving.model_name,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            store=req.store is not False,
            temperature=run.params.temperature,
            top_p=run.params.top_p,
            text=req.text or TextConfig(),
            tool_choice=req.tool_choice,
            tools=req.tools or [],
            user=req.user,
        )

    def _stream(self, run: ChatRun, draft: ResponsesResponse, items: list[InputItem]) -> SSEResponse:
        events = EventCounter()

        async def body() -> AsyncIterator[dict[str, Any]]:
            try:
                async for event in self._events(run, draft, items, events):
                    yield event
            finally:
                self.serving.log_access(run.request_id, [run.prompt], events.output_tokens, run.started)

        return sse_response(
            body(), on_close=lambda: self.serving.abort(run.streams), named=True, error_event=events.error
        )

    async def _events(
        self, run: ChatRun, draft: ResponsesResponse, items: list[InputItem], events: EventCounter
    ) -> AsyncIterator[dict[str, Any]]:
        """Reasoning and text stream as they come; tool calls (and text that may be one) are held back
        and sent whole."""
        serving = self.serving
        yield events.event("response.created", response=dump(draft))
        yield events.event("response.in_progress", response=dump(draft))
        tracker, keep, ids = Tracker(), holdback(run.params), ItemIds()
        reasoning = run.reasoning.parser(run.prompt.text) if run.reasoning is not None else None
        holds = run.tools is not None and holds_tool_call(run.tools)
        opened: list[str] = []  # NOTE: ids of the items begun while streaming, in output order
        closed: set[str] = set()  # ids of the items also ended while streaming
        last: CompletionOutput | None = None
        cached = 0
        async for _, output in until_timeout(serving, merged(serving, run.streams)):
            last = self.chat.visible(run, output.outputs[0])
            cached = output.num_cached_tokens or 0
            events.output_tokens = len(last.token_ids)
            delta = tracker.advance(last, keep, False)
            if delta is None:
                continue
            text = delta.text
            if reasoning is not None:
                split = reasoning.feed(text, final=delta.finish_reason is not None)
                if split.reasoning and not opened:
                    opened.append(ids.reasoning)
                    begun = ReasoningItem(id=ids.reasoning, status="in_progress", content=[])
                    for event in part_opened(events, 0, begun, ReasoningText(text="")):
                        yield event
                if split.reasoning:
                    yield reasoning_delta(events, 0, ids.reasoning, split.reasoning)
                if ids.reasoning in opened and reasoning.reasoning_end is not None and ids.reasoning not in closed:
                    closed.add(ids.reasoning)  # NOTE: the reasoning item ends before the answer's begin
                    done = ReasoningItem(
                        id=ids.reasoning, status="completed", content=[ReasoningText(text=reasoning.reasoning)]
                    )
                    for event in item_done(events, 0, done):
                        yield event
                text = split.content
            if not text or holds:
                continue
            if ids.message not in opened:
                opened.append(ids.message)
                for event in message_opened(events, len(opened) - 1, ids.message):
                    yield event
            yield text_delta(events, len(opened) - 1, ids.message, text)
        assert last is not None, "a stream ends with a finished output or an error"
        # NOTE: text already sent as a message stays one, so the final response matches the stream.
        tools = None if ids.message in opened else run.tools
        response = finish(draft, run, last, self.chat.answer(run, last), ids, tools, cached)
        for index, item in enumerate(response.output):
            if item.id in closed:
                continue
            for event in (item_done if item.id in opened else item_whole)(events, index, item):
                yield event
        self._remember(response, items)
        yield events.event(f"response.{response.status}", response=dump(response))


# -- request: input items to chat ------------------------------------------------------------------
def input_items(value: str | list[InputItem]) -> list[InputItem]:
    return [InputMessage(role="user", content=value)] if isinstance(value, str) else list(value)


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[ChatMessage]:
    """The conversation as chat messages: instructions first, as a system message.

    ``developer`` messages become ``system`` ones (chat templates know no other); a run of
    function calls joins the assistant message before it, and their outputs are ``tool`` messages.
    """
    messages = [ChatMessage(role="system", content=instructions)] if instructions is not None else []
    for item in items:
        if isinstance(item, ReasoningInput):
            continue  # NOTE: chat templates show no earlier turn's reasoning
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=_text(item.content)))
        elif isinstance(item, FunctionCallInput):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
    return messages


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat completion that answers ``req``."""
    tools = [
        {
            "type": "function",
            "function": tool.model_dump(include={"name", "description", "parameters"}, exclude_none=True),
        }
        for tool in req.tools or []
    ]
    choice = req.tool_choice
    return ChatCompletionRequest.model_validate(
        {
            "model": req.model,
            "messages": messages,
            "max_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": req.stream,
            "user": req.user,
            "cache_salt": req.cache_salt,
            "tools": tools or None,
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, FunctionToolChoice)
            else choice,
            "response_format": response_format(req.text),
            "structured_outputs": req.structured_outputs,
            "parallel_tool_calls": req.parallel_tool_calls,
            "chat_template_kwargs": req.chat_template_kwargs,
            "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        }
    )


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request(
            "text.format.schema is required with type json_schema: give the JSON schema", "text.format.schema"
        )
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}


# -- answer: output items ---------------------------------------------------------------------------
class ItemIds:
    """The ids of a response's reasoning and message items, made up front so that a stream and its
    final response name them alike."""

    def __init__(self) -> None:
        self.reasoning = new_id("rs")
        self.message = new_id("msg")


def finish(
    draft: ResponsesResponse,
    run: ChatRun,
    c: CompletionOutput,
    answer: Answer,
    ids: ItemIds,
    tools: ToolPlan | None,
    cached_tokens: int = 0,
) -> ResponsesResponse:
    """The finished response of choice ``c``: its reasoning, its answer as a message, its tool calls as
    function calls."""
    content, calls = parse_tool_calls(tools, c, answer.text)
    status: Literal["completed", "incomplete"] = "completed" if c.finish_reason == "stop" else "incomplete"
    output: list[OutputItem] = []
    if answer.reasoning:
        # NOTE: reasoning the model closed is complete, even when the answer after it was cut short
        done: Literal["completed", "incomplete"] = "completed" if answer.reasoning_closed else status
        output.append(ReasoningItem(id=ids.reasoning, status=done, content=[ReasoningText(text=answer.reasoning)]))
    if content or not calls:
        output.append(OutputMessage(id=ids.message, status=status, content=[OutputText(text=content or "")]))
    output += [
        FunctionCall(id=new_id("fc"), call_id=new_id("call"), name=call.name, arguments=call.arguments)
        for call in calls
    ]
    input_tokens, output_tokens = len(run.prompt.token_ids), len(c.token_ids)
    usage = ResponseUsage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tokens=input_tokens + output_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=answer.reasoning_tokens),
    )
    incomplete = IncompleteDetails(reason="max_output_tokens") if c.finish_reason == "length" else None
    return draft.model_copy(
        update={"status": status, "output": output, "usage": usage, "incomplete_details": incomplete}
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
