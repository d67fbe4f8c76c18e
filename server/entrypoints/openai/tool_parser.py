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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.server.entrypoints.openai.call_object import CallObject
from pagedllm.server.entrypoints.openai.markers import partial_suffix
from pagedllm.server.entrypoints.openai.tool_call_writer import CallWriter, OpenCall, StreamingCallParser, ToolCall

if TYPE_CHECKING:
    from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan

TOOL_CALL_OPEN, TOOL_CALL_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


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
    call: OpenCall | None = None  # its header, once decided on (streamed, or dropped by parallel_tool_calls)
    sent: int = 0  # characters of its arguments streamed

    @property
    def index(self) -> int | None:
        """Its index among the streamed calls (None: not announced, or dropped)."""
        return self.call.index if self.call is not None else None


class ToolCallParser(StreamingCallParser):
    """One choice's text, fed as it grows (:meth:`feed`), read into content and tool calls.

    :meth:`feed` and :meth:`finish` return the choice's next ``delta`` messages in OpenAI's
    streaming shape. NOTE: a call's header is a delta of its own (arguments ``""``); every
    later delta of the call carries only ``index`` and an ``arguments`` fragment. Whitespace
    between text and calls is dropped at the start and end of the content, as a non-streamed
    reply strips it.
    """

    def __init__(self, plan: ToolPlan) -> None:
        state = {"named": _State.ARGUMENTS, "required": _State.LIST_START}.get(plan.mode, _State.START)
        super().__init__(CallWriter(plan), state)
        self.plan = plan
        self._reading: _Reading | None = None

    def _ended(self) -> None:
        reading = self._reading
        if self._state is _State.ARGUMENTS and reading is not None and reading.call is not None:
            self.out.calls.append(ToolCall(self.plan.named or "", self._text, reading.call.id))

    def steps(self) -> dict[Any, Callable[[], bool]]:
        return {
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
        if reading.call is None and obj.name is not None:
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
            if reading.call is None:
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
        reading.call = self.out.open(name)  # NOTE: dropped (index None) past the first with parallel_tool_calls=false

    def _stream_arguments(self, reading: _Reading) -> None:
        arguments = reading.obj.arguments()
        self._fragment(reading, arguments[reading.sent :])

    def _fragment(self, reading: _Reading, text: str) -> None:
        if not text:
            return
        reading.sent += len(text)
        assert reading.call is not None
        self.out.arguments(reading.call, text)

    def _end_call(self, reading: _Reading) -> None:
        obj = reading.obj
        assert obj.name is not None
        if reading.call is not None and reading.call.index is not None:
            self.out.calls.append(ToolCall(obj.name, obj.arguments(), reading.call.id))
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

    def _content(self, text: str) -> None:
        self.out.text(text)
