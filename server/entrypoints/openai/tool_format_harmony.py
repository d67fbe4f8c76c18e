"""``--tool-call-parser openai``: gpt-oss's calls, harmony messages addressed to a function::

    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(one line in the text)
(the recipient may also follow the channel). A call's header streams when its ``<|message|>``
is read, its body as argument fragments as they arrive; ``<|call|>`` (or the end of the text:
it is an end-of-sequence token) closes it. ``final`` and preamble (``commentary`` without a
recipient) bodies are the content; ``analysis`` bodies are reasoning, never content (without
``--reasoning-parser openai_gptoss`` they are dropped). Recipients outside ``functions.`` (the
built-in ``browser`` and ``python`` tools) are not the request's functions: they are dropped.
Text outside any message is content.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.server.entrypoints.openai.harmony import Event, HarmonyReader
from pagedllm.server.entrypoints.openai.tool_call_writer import CallWriter, OpenCall, ToolCall

if TYPE_CHECKING:
    from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan

FUNCTIONS = "functions."


class HarmonyCallParser:
    """Reads one choice's harmony messages for calls (see the module)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.out = CallWriter(plan)
        self.reader = HarmonyReader()
        self._call: OpenCall | None = None

    @property
    def calls(self) -> list[ToolCall]:
        return self.out.calls

    @property
    def content(self) -> str:
        return self.out.content

    def feed(self, text: str) -> list[dict[str, Any]]:
        for event in self.reader.feed(text):
            self._take(event)
        return self.out.take()

    def finish(self) -> list[dict[str, Any]]:
        for event in self.reader.feed("", final=True):
            self._take(event)
        self.out.finish()
        return self.out.take()

    def _take(self, event: Event) -> None:
        header = event.header
        if header is None:
            self.out.text(event.text)
        elif header.kind == "answer":
            if event.kind == "body":
                self.out.text(event.text)
        elif header.kind == "call" and (header.recipient or "").startswith(FUNCTIONS):
            self._call_event(event, (header.recipient or "")[len(FUNCTIONS) :])

    def _call_event(self, event: Event, name: str) -> None:
        if event.kind == "header":
            self._call = self.out.open(name)
        elif self._call is not None and event.kind == "body":
            self.out.arguments(self._call, event.text)
        elif self._call is not None and event.kind == "end":
            if not self._call.arguments.strip():
                self.out.arguments(self._call, "{}")
            self.out.close(self._call)
            self._call = None
