"""The Responses API's stream events: each numbered by ``sequence_number``, for output items that
stream as they are written (reasoning, a message's text) or are sent whole (function calls, text
held back while it may be a call). :mod:`.serving_responses` says in which order they come."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedllm.server.entrypoints.openai.errors import APIError
from pagedllm.server.entrypoints.openai.protocol_responses import (
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


class EventCounter:
    """Numbers a stream's events (``sequence_number``) and counts the tokens it carried (for the log)."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output_tokens = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def error(self, error: APIError) -> dict[str, Any]:
        """The Responses API's error event; its ``error`` object (OpenAI's shape) makes the client raise."""
        body = error.body()["error"]
        return self.event("error", code=str(error.code), message=error.message, param=error.param, error=body)


def part_opened(
    events: EventCounter, index: int, item: OutputMessage | ReasoningItem, part: OutputText | ReasoningText
) -> list[dict[str, Any]]:
    """An item of one text part begins: the item, then its empty part."""
    return [
        events.event("response.output_item.added", output_index=index, item=dump(item)),
        events.event(
            "response.content_part.added", item_id=item.id, output_index=index, content_index=0, part=dump(part)
        ),
    ]


def message_opened(events: EventCounter, index: int, item_id: str) -> list[dict[str, Any]]:
    return part_opened(events, index, OutputMessage(id=item_id, status="in_progress", content=[]), OutputText(text=""))


def text_delta(events: EventCounter, index: int, item_id: str, text: str) -> dict[str, Any]:
    return events.event(
        "response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text, logprobs=[]
    )


def reasoning_delta(events: EventCounter, index: int, item_id: str, text: str) -> dict[str, Any]:
    return events.event(
        "response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text
    )


def item_done(events: EventCounter, index: int, item: OutputItem) -> list[dict[str, Any]]:
    """The events that close an item whose beginning (and any text) was sent."""
    if isinstance(item, OutputMessage | ReasoningItem):
        part = item.content[0]
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        text_done = (
            events.event("response.output_text.done", **where, text=part.text, logprobs=[])
            if isinstance(item, OutputMessage)
            else events.event("response.reasoning_text.done", **where, text=part.text)
        )
        closing = [text_done, events.event("response.content_part.done", **where, part=dump(part))]
    else:
        closing = [
            events.event(
                "response.function_call_arguments.done", item_id=item.id, output_index=index, arguments=item.arguments
            )
        ]
    return [*closing, events.event("response.output_item.done", output_index=index, item=dump(item))]


def item_whole(events: EventCounter, index: int, item: OutputItem) -> list[dict[str, Any]]:
    """All the events of an item held back until the choice finished."""
    if isinstance(item, OutputMessage):
        sent = message_opened(events, index, item.id)  # NOTE: in order: each call numbers its events
        if item.content[0].text:
            sent.append(text_delta(events, index, item.id, item.content[0].text))
        return sent + item_done(events, index, item)
    if isinstance(item, ReasoningItem):
        begun = item.model_copy(update={"status": "in_progress", "content": []})
        sent = part_opened(events, index, begun, ReasoningText(text=""))
        sent.append(reasoning_delta(events, index, item.id, item.content[0].text))
        return sent + item_done(events, index, item)
    added = item.model_copy(update={"arguments": "", "status": "in_progress"})
    return [
        events.event("response.output_item.added", output_index=index, item=dump(added)),
        events.event(
            "response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=item.arguments
        ),
        *item_done(events, index, item),
    ]
