"""``--tool-call-parser pythonic``: calls as a Python list, as Llama-3.2 and Llama-4 write them::

    [get_weather(city="Paris", unit="C"), get_time(zone="CET")]

(Llama-4 may wrap the list in ``<|python_start|>`` … ``<|python_end|>``; both are dropped.)
The list is the whole answer; text that does not begin with one is content. Keyword values
are Python literals, read with :func:`ast.literal_eval` (never evaluated). A call streams as
it is written: its header at ``name(``, then ``{"city": "Paris"``, ``, "unit": "C"``, ``}``
as each keyword argument and the call close. NOTE: the list is read as calls only when its
first call names one of the request's tools (a list of other calls is text).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.server.entrypoints.openai.tool_call_writer import CallWriter, Extent, OpenCall, StreamingCallParser

if TYPE_CHECKING:
    from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicParser(StreamingCallParser):
    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(CallWriter(plan), "start")
        self._names = plan.names
        self._call: OpenCall | None = None
        self._argument: Extent | None = None
        self._argument_from = 0

    def steps(self) -> dict[Any, Callable[[], bool]]:
        return {
            "start": self._start,
            "list": self._list,
            "call": self._call_name,
            "arguments": self._arguments,
            "after": self._after,
            "content": self._content,
        }

    def _head(self, chars: str = " \t\r\n") -> str:
        rest = self._rest
        head = rest.lstrip(chars)
        self._pos += len(rest) - len(head)
        return head

    # -- states (each returns whether it made progress) -----------------------------------------------------
    def _start(self) -> bool:
        rest = self._rest
        head = rest.lstrip()
        if head.startswith(PYTHON_START):
            head = head[len(PYTHON_START) :].lstrip()
        if not self._final and (not head or PYTHON_START.startswith(head)):
            return False
        if head.startswith("[") and (len(head) > 1 or not self._final):
            self._pos = len(self._text) - len(head) + 1
            self._state = "list"
        else:
            self._state = "content"
        return True

    def _list(self) -> bool:
        head = self._head(" \t\r\n,")
        if not head:
            return self._not_calls() if self._final else False
        if head.startswith("]"):
            self._pos += 1
            self._state = "after"
            return True
        self._state = "call"
        return True

    def _call_name(self) -> bool:
        head = self._rest
        paren = head.find("(")
        name = head[:paren].strip() if paren >= 0 else head.strip()
        if not name.isidentifier() and name or paren < 0 and self._final:
            return self._not_calls()
        if paren < 0:
            return False
        if not self.out.calls and self._call is None and name not in self._names:
            return self._not_calls()
        self._call = self.out.open(name)
        self._pos += paren + 1
        self._begin_argument()
        return True

    def _begin_argument(self) -> None:
        self._argument, self._argument_from, self._state = Extent(quotes="'\""), self._pos, "arguments"

    def _arguments(self) -> bool:
        """Read up to a top-level ``,`` or ``)``: one keyword argument is complete."""
        extent, call = self._argument, self._call
        assert extent is not None and call is not None
        for ch in self._rest:
            if not extent.in_string and extent.depth == 0 and ch in ",)":
                if not self._add_argument(self._text[self._argument_from : self._pos]):
                    return self._broken()
                self._pos += 1
                if ch == ")":
                    self.out.arguments(call, "}" if call.arguments else "{}")
                    self.out.close(call)
                    self._state = "list"
                else:
                    self._begin_argument()
                return True
            extent.read(ch)
            self._pos += 1
        return self._broken() if self._final else False

    def _add_argument(self, text: str) -> bool:
        call = self._call
        assert call is not None
        if not text.strip():
            return True
        try:
            (keyword,) = ast.parse(f"f({text})", mode="eval").body.keywords  # type: ignore[attr-defined]
            value = json.dumps(ast.literal_eval(keyword.value), ensure_ascii=False)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return False
        if keyword.arg is None:
            return False
        self.out.arguments(call, f"{', ' if call.arguments else '{'}{json.dumps(keyword.arg)}: {value}")
        return True

    def _after(self) -> bool:
        """After the list: Llama-4's closing tag is dropped; anything else is text."""
        head = self._head()
        if not self._final and (not head or PYTHON_END.startswith(head)):
            return False
        if head.startswith(PYTHON_END):
            self._pos += len(PYTHON_END)
        self._state = "content"
        return True

    def _content(self) -> bool:
        self.out.text(self._rest)
        self._pos = len(self._text)
        return False

    def _not_calls(self) -> bool:
        """Nothing was sent as a call: the whole text is content after all."""
        if not self.out.calls and self._call is None:
            self._pos = 0
        self._state = "content"
        return True

    def _broken(self) -> bool:
        """A call that does not read: it stays incomplete (its header may have streamed); the rest is text."""
        self._state = "content"
        return True
