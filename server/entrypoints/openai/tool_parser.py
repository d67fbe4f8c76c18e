"""Reading a choice's text, as it grows, into text content and tool calls in OpenAI's streaming shape.

:class:`ToolCallParser` says what to stream after each piece of text: content, a call's
header (``index``, ``id``, ``type``, ``function.name`` with empty ``arguments``), then
fragments of its arguments as the model writes them, which is how the ``openai`` client
accumulates a streamed call. A non-streamed reply runs the same parser over the whole
text (:meth:`ToolPlan.parse`), so the two always agree.

Text the parser is not yet sure about (a ``<tool_call>`` tag arriving, a JSON object whose
name is not read yet) is held back, then sent as a call or, if it is none, as text::

    Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>
    └───┘ └── held, then the header ───┘               └─ fragments ─┘
    text
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.server.entrypoints.openai.call_object import CallObject
from pagedllm.server.entrypoints.openai.markers import partial_suffix

if TYPE_CHECKING:
    from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan

TOOL_CALL_OPEN, TOOL_CALL_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class _State(enum.Enum):
    START = "start"  # auto: only whitespace (or <|python_tag|>) so far: text, or a bare call?
    CONTENT = "content"  # text, watched for <tool_call>
    TAG_BODY = "tag_body"  # after <tool_call>, before its object
    CALL = "call"  # inside a call object
    TAG_END = "tag_end"  # after a tagged call's object, before </tool_call>
    LIST_START = "list_start"  # required: before the list
    LIST = "list"  # required: inside the list, between calls
    ARGUMENTS = "arguments"  # named: the whole text is the arguments
    DONE = "done"  # required: after the list; the rest is ignored


@dataclass
class _Reading:
    """The call object being read: where its held text began, and what of it was streamed."""

    obj: CallObject
    held_from: int  # NOTE: text from here on is content again if this turns out not to be a call
    tagged: bool
    index: int | None = None  # set when its header is streamed (None: not a call, or dropped)
    id: str = field(default_factory=_call_id)
    sent: int = 0  # characters of its arguments streamed
    announced: bool = False  # its header was decided on (streamed, or dropped by parallel_tool_calls)


class ToolCallParser:
    """One choice's text, fed as it grows (:meth:`feed`), read into content and tool calls.

    :meth:`feed` and :meth:`finish` return the choice's next ``delta`` messages in OpenAI's
    streaming shape. NOTE: a call's header is a delta of its own (arguments ``""``); every
    later delta of the call carries only ``index`` and an ``arguments`` fragment. Whitespace
    between text and calls is dropped at the start and end of the content, as a non-streamed
    reply strips it.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []
        """Complete calls, in order."""
        self.content = ""
        """The text content streamed so far."""
        self._text = ""
        self._pos = 0  # NOTE: self._text[:self._pos] has been read; the rest waits for more text
        self._final = False
        self._state = {"named": _State.ARGUMENTS, "required": _State.LIST_START}.get(plan.mode, _State.START)
        self._reading: _Reading | None = None
        self._num_indexes = 0
        self._pending_space = ""  # trailing whitespace of the content, sent only if more content follows
        self._deltas: list[dict[str, Any]] = []

    # -- feeding ------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """Read ``text`` (what the choice's text gained); the deltas to stream for it."""
        self._text += text
        self._run()
        return self._take_deltas()

    def finish(self) -> list[dict[str, Any]]:
        """The choice ended: resolve what was held back; the last deltas to stream."""
        self._final = True
        self._run()
        if self._state is _State.ARGUMENTS and self._reading is not None:
            self.calls.append(ToolCall(self.plan.named or "", self._text, self._reading.id))
        if self._pending_space and not self._num_indexes:
            self._emit_content(self._pending_space)
        self._pending_space = ""
        return self._take_deltas()

    def _run(self) -> None:
        steps = {
            _State.START: self._start,
            _State.CONTENT: self._content_text,
            _State.TAG_BODY: self._tag_body,
            _State.CALL: self._call,
            _State.TAG_END: self._tag_end,
            _State.LIST_START: self._list_start,
            _State.LIST: self._list,
            _State.ARGUMENTS: self._arguments,
            _State.DONE: self._done,
        }
        while steps[self._state]():
            pass

    @property
    def _rest(self) -> str:
        return self._text[self._pos :]

    def _waits_for(self, rest: str, *tokens: str) -> bool:
        """Whether ``rest`` may still grow into one of ``tokens`` (so it is held back)."""
        return not self._final and any(t.startswith(rest) for t in tokens)

    # -- states (each returns whether it made progress) -------------------------------------------------------
    def _start(self) -> bool:
        rest = self._rest
        head = rest.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        if head.startswith("{"):
            self._begin_call(self._pos, len(rest) - len(head), tagged=False)
            return True
        if not head and not self._final or self._waits_for(head, PYTHON_TAG):
            return False
        self._state = _State.CONTENT
        return True

    def _content_text(self) -> bool:
        rest = self._rest
        at = rest.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._content(rest[:at])
            self._pos += at + len(TOOL_CALL_OPEN)
            self._state = _State.TAG_BODY
            return True
        keep = 0 if self._final else partial_suffix(rest, (TOOL_CALL_OPEN,))
        self._content(rest[: len(rest) - keep])
        self._pos += len(rest) - keep
        return False

    def _tag_body(self) -> bool:
        rest = self._rest
        head = rest.lstrip()
        if head.startswith("{"):
            self._begin_call(self._pos - len(TOOL_CALL_OPEN), len(rest) - len(head), tagged=True)
            return True
        if not head and not self._final:
            return False
        self._not_a_call(self._pos - len(TOOL_CALL_OPEN), tagged=True)
        return True

    def _call(self) -> bool:
        reading = self._reading
        assert reading is not None
        self._pos += reading.obj.feed(self._rest)
        obj = reading.obj
        if not reading.announced and obj.name is not None:
            if self.plan.mode == "auto" and obj.name not in self.plan.names:
                self._not_a_call(reading.held_from, reading.tagged)
                return True
            self._announce(reading, obj.name)
        if reading.index is not None:
            self._stream_arguments(reading)
        if obj.closed and obj.name is not None:
            self._end_call(reading)
            return True
        if obj.invalid or obj.closed or self._final:
            if not reading.announced:
                self._not_a_call(reading.held_from, reading.tagged)
            else:  # NOTE: already streamed; it stays incomplete, and the rest is text
                self._reading, self._state = None, _State.CONTENT
            return True
        return False

    def _tag_end(self) -> bool:
        rest = self._rest
        head = rest.lstrip()
        if not head and not self._final or self._waits_for(head, TOOL_CALL_CLOSE):
            return False
        if head.startswith(TOOL_CALL_CLOSE):
            self._pos += len(rest) - len(head) + len(TOOL_CALL_CLOSE)
        self._state = _State.CONTENT
        return True

    def _list_start(self) -> bool:
        head = self._rest.lstrip()
        if not head:
            return False
        if head.startswith("["):
            self._pos += len(self._rest) - len(head) + 1
            self._state = _State.LIST
        else:
            self._state = _State.LIST  # NOTE: a lone call object is read as a list of one
        return True

    def _list(self) -> bool:
        rest = self._rest
        head = rest.lstrip(" \t\r\n,")
        if not head:
            self._pos = len(self._text)
            return False
        if head.startswith("{"):
            self._begin_call(self._pos, len(rest) - len(head), tagged=False)
        else:
            self._state = _State.DONE
        return True

    def _arguments(self) -> bool:
        if self._reading is None:
            self._reading = _Reading(CallObject(), 0, tagged=False)
            self._announce(self._reading, self.plan.named or "")
        self._fragment(self._reading, self._rest)
        self._pos = len(self._text)
        return False

    def _done(self) -> bool:
        self._pos = len(self._text)
        return False

    # -- calls ----------------------------------------------------------------------------------------------
    def _begin_call(self, held_from: int, skip: int, tagged: bool) -> None:
        self._pos += skip
        self._reading = _Reading(CallObject(), held_from, tagged)
        self._state = _State.CALL

    def _announce(self, reading: _Reading, name: str) -> None:
        reading.announced = True
        if self._num_indexes and not self.plan.parallel:
            return  # NOTE: parallel_tool_calls=false: later calls are read, and dropped
        reading.index, self._num_indexes = self._num_indexes, self._num_indexes + 1
        self._deltas.append(
            {
                "tool_calls": [
                    {
                        "index": reading.index,
                        "id": reading.id,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
            }
        )

    def _stream_arguments(self, reading: _Reading) -> None:
        arguments = reading.obj.arguments()
        self._fragment(reading, arguments[reading.sent :])

    def _fragment(self, reading: _Reading, text: str) -> None:
        if not text:
            return
        reading.sent += len(text)
        last = self._deltas[-1] if self._deltas else None
        calls = last.get("tool_calls") if last is not None else None
        if calls and "id" not in calls[-1] and calls[-1]["index"] == reading.index:
            calls[-1]["function"]["arguments"] += text
        else:
            self._deltas.append({"tool_calls": [{"index": reading.index, "function": {"arguments": text}}]})

    def _end_call(self, reading: _Reading) -> None:
        obj = reading.obj
        assert obj.name is not None
        if reading.index is not None:
            self.calls.append(ToolCall(obj.name, obj.arguments(), reading.id))
        self._reading = None
        self._state = {"required": _State.LIST}.get(
            self.plan.mode, _State.TAG_END if reading.tagged else _State.CONTENT
        )

    def _not_a_call(self, held_from: int, tagged: bool) -> None:
        """What was held back as a possible call is text after all: read it again as text.

        NOTE: a tag that opened no call is text; reading resumes after it, so it is not taken
        for a tag again.
        """
        self._reading = None
        if tagged:
            self._content(TOOL_CALL_OPEN)
            held_from += len(TOOL_CALL_OPEN)
        self._pos, self._state = held_from, _State.CONTENT

    # -- content ----------------------------------------------------------------------------------------------
    def _content(self, text: str) -> None:
        if not self.content and self._num_indexes:
            text, self._pending_space = text.lstrip(), ""  # NOTE: the content begins after the calls before it
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body) :]
        if body:
            self._emit_content(body)

    def _emit_content(self, text: str) -> None:
        self.content += text
        last = self._deltas[-1] if self._deltas else None
        if last is not None and "content" in last:
            last["content"] += text
        else:
            self._deltas.append({"content": text})

    def _take_deltas(self) -> list[dict[str, Any]]:
        deltas, self._deltas = self._deltas, []
        return deltas
