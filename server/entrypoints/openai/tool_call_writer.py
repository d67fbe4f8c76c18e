"""The deltas a tool-call parser streams: text content, a call's header, then its argument fragments.

Shared by every tool-call parser, so every format streams what the ``openai`` client
accumulates: a call's header is a delta
of its own (``index``, ``id``, ``type``, ``function.name``, arguments ``""``); every later delta
of the call carries only ``index`` and an ``arguments`` fragment.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class OpenCall:
    """A call whose header was decided on; ``index`` is None when ``parallel_tool_calls=false`` dropped it."""

    name: str
    id: str
    index: int | None
    arguments: str = ""


class CallWriter:
    """Collects one choice's content and calls, and the deltas that stream them.

    NOTE: whitespace between text and calls is dropped at the start and end of the content,
    as a non-streamed reply strips it.
    """

    def __init__(self, plan: ToolPlan, make_id: Callable[[], str] = new_call_id) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []
        """Complete calls, in order."""
        self.content = ""
        """The text content so far."""
        self._make_id = make_id
        self._deltas: list[dict[str, Any]] = []
        self._pending_space = ""
        self._num_indexes = 0

    def text(self, text: str) -> None:
        if not self.content and self._num_indexes:
            text, self._pending_space = text.lstrip(), ""  # NOTE: the content begins after the calls before it
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body) :]
        if body:
            self._emit_content(body)

    def open(self, name: str) -> OpenCall:
        """A call named ``name`` begins: its header is streamed (unless it is dropped)."""
        call = OpenCall(name, self._make_id(), None)
        if self._num_indexes and not self.plan.parallel:
            return call  # NOTE: parallel_tool_calls=false: later calls are read, and dropped
        call.index, self._num_indexes = self._num_indexes, self._num_indexes + 1
        header = {"index": call.index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}
        self._deltas.append({"tool_calls": [header]})
        return call

    def arguments(self, call: OpenCall, text: str) -> None:
        """``text`` adds to the call's arguments (JSON text)."""
        if not text:
            return
        call.arguments += text
        if call.index is None:
            return
        last = self._deltas[-1] if self._deltas else None
        calls = last.get("tool_calls") if last is not None else None
        if calls and "id" not in calls[-1] and calls[-1]["index"] == call.index:
            calls[-1]["function"]["arguments"] += text
        else:
            self._deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": text}}]})

    def close(self, call: OpenCall) -> None:
        """The call is complete."""
        if call.index is not None:
            self.calls.append(ToolCall(call.name, call.arguments, call.id))

    def finish(self) -> None:
        if self._pending_space and not self._num_indexes:
            self._emit_content(self._pending_space)
        self._pending_space = ""

    def take(self) -> list[dict[str, Any]]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def _emit_content(self, text: str) -> None:
        self.content += text
        last = self._deltas[-1] if self._deltas else None
        if last is not None and "content" in last:
            last["content"] += text
        else:
            self._deltas.append({"content": text})


class Extent:
    """Where a bracketed value ends, read as its characters arrive: JSON (``"`` strings) or a
    Python literal (``'`` and ``"`` strings). Text before the first bracket is not part of it."""

    def __init__(self, quotes: str = '"') -> None:
        self.quotes = quotes
        self.depth = 0
        self.started = False
        self.done = False
        self._quote: str | None = None
        self._escape = False

    def feed(self, text: str) -> int:
        """Read ``text``; returns how many characters belong to the value (all, until it ends)."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            self.read(ch)
        return len(text)

    def read(self, ch: str) -> None:
        if self._quote is not None:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == self._quote:
                self._quote = None
        elif ch in self.quotes:
            self._quote = ch
        elif ch in "{[(":
            self.depth, self.started = self.depth + 1, True
        elif ch in "}])":
            self.depth -= 1
            self.done = self.started and self.depth <= 0

    @property
    def in_string(self) -> bool:
        return self._quote is not None


class StreamingCallParser:
    """What the streaming call parsers share: the text so far, a read position, and a state
    machine run over whatever has arrived (:meth:`steps`: state -> a step that returns whether
    it made progress, so the run goes on).

    Subclasses set their first state and their own fields, and write to ``self.out``.
    """

    def __init__(self, out: CallWriter, state: Any) -> None:
        self.out = out
        self._text = ""
        self._pos = 0  # NOTE: self._text[:self._pos] has been read; the rest waits for more text
        self._final = False
        self._state = state

    def steps(self) -> dict[Any, Callable[[], bool]]:
        """State -> its step."""
        raise NotImplementedError

    @property
    def calls(self) -> list[ToolCall]:
        return self.out.calls

    @property
    def content(self) -> str:
        return self.out.content

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        self._run()
        return self.out.take()

    def finish(self) -> list[dict[str, Any]]:
        self._final = True
        self._run()
        self._ended()
        self.out.finish()
        return self.out.take()

    def _ended(self) -> None:
        """What a parser settles once the text is complete, before the content's last whitespace."""

    def _run(self) -> None:
        steps = self.steps()
        while steps[self._state]():
            pass

    @property
    def _rest(self) -> str:
        return self._text[self._pos :]
