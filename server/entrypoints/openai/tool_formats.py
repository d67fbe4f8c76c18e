"""The tool-call formats ``--tool-call-parser NAME`` picks (vLLM's names), for ``tool_choice="auto"``.

``hermes`` and ``llama3_json`` are read by :class:`~.tool_parser.ToolCallParser` (which reads
both, as without the flag); the others by the parsers here. Whatever the format,
``tool_choice="required"`` or a named function generate JSON under a grammar, read by
:class:`~.tool_parser.ToolCallParser`. Formats, from each family's published chat template:

- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral-7B-Instruct-v0.3,
  Mixtral; tokenizer v3) or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (tokenizer v11 and
  later: Mistral-Small-3.2, Magistral, Devstral); call ids are 9 letters and digits, as
  Mistral's templates require of the ids given back.
- ``granite``: ``<|tool_call|>[{"name": ..., "arguments": {...}}]`` (IBM Granite 3.0; 3.1 and
  later also write ``<tool_call>``).
- ``internlm``: ``<|action_start|><|plugin|>\\n{"name": ..., "parameters": {...}}<|action_end|>``
  (InternLM2.5-chat).
- ``jamba``: ``<tool_calls>[{"name": ..., "arguments": {...}}]</tool_calls>`` (AI21 Jamba 1.5).
- ``qwen3_coder`` (:mod:`.tool_format_xml`) and ``pythonic`` (:mod:`.tool_format_pythonic`;
  ``llama4_pythonic`` is the same reader, under the name vLLM gives Llama-4's).
- ``openai``: gpt-oss's harmony messages to ``functions.NAME`` (:mod:`.tool_format_harmony`).

NOTE: ``[TOOL_CALLS]``, ``<|tool_call|>`` and ``<|action_start|>`` are special tokens, which the
detokenizer drops by default: a request read with one of these formats keeps them
(:attr:`ToolFormat.needs_special_tokens`).
"""

from __future__ import annotations

import enum
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.server.entrypoints.openai.call_object import CallObject
from pagedllm.server.entrypoints.openai.markers import first_of, partial_suffix
from pagedllm.server.entrypoints.openai.tool_call_writer import (
    CallWriter,
    Extent,
    OpenCall,
    StreamingCallParser,
    ToolCall,
)
from pagedllm.server.entrypoints.openai.tool_parser import ToolCallParser

if TYPE_CHECKING:
    from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan


class CallParser(Protocol):
    """What a chat choice's text is read with: deltas per piece of text, then the calls."""

    @property
    def calls(self) -> list[ToolCall]:
        """The calls read so far."""
        ...

    @property
    def content(self) -> str:
        """The text that is not a call."""
        ...

    def feed(self, text: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class ToolFormat:
    name: str
    needs_special_tokens: bool = False
    """Its markers are special tokens: the request's text must keep them."""


TOOL_FORMATS = {
    f.name: f
    for f in (
        ToolFormat("hermes"),
        ToolFormat("llama3_json", needs_special_tokens=True),  # NOTE: <|python_tag|>
        ToolFormat("mistral", needs_special_tokens=True),
        ToolFormat("qwen3_coder"),
        ToolFormat("pythonic", needs_special_tokens=True),  # NOTE: Llama-4's <|python_start|>
        ToolFormat("granite", needs_special_tokens=True),
        ToolFormat("internlm", needs_special_tokens=True),
        ToolFormat("jamba", needs_special_tokens=True),
        ToolFormat("llama4_pythonic", needs_special_tokens=True),
        ToolFormat("openai", needs_special_tokens=True),  # NOTE: harmony's <|channel|>, <|message|>, ...
    )
}
TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)
"""The names ``--tool-call-parser`` takes."""


def make_parser(name: str, plan: ToolPlan) -> CallParser:
    """The parser of format ``name`` for a request's ``auto`` tool choice."""
    from pagedllm.server.entrypoints.openai.tool_format_harmony import HarmonyCallParser
    from pagedllm.server.entrypoints.openai.tool_format_pythonic import PythonicParser
    from pagedllm.server.entrypoints.openai.tool_format_xml import Qwen3CoderParser

    if name == "mistral":
        return MarkedJsonParser(plan, ("[TOOL_CALLS]",), name_args="[ARGS]", make_id=mistral_call_id)
    if name == "granite":
        return MarkedJsonParser(plan, ("<|tool_call|>", "<tool_call>"))
    if name == "internlm":
        return MarkedJsonParser(plan, ("<|action_start|><|plugin|>",), close="<|action_end|>")
    if name == "qwen3_coder":
        return Qwen3CoderParser(plan)
    if name == "jamba":
        return MarkedJsonParser(plan, ("<tool_calls>",), close="</tool_calls>")
    if name in ("pythonic", "llama4_pythonic"):
        return PythonicParser(plan)
    if name == "openai":
        return HarmonyCallParser(plan)
    return ToolCallParser(plan)


def mistral_call_id() -> str:
    """Mistral's templates take back only ids of 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class _State(enum.Enum):
    CONTENT = "content"  # text, watched for a marker
    BODY = "body"  # after a marker: a list, an object, or a name
    LIST = "list"  # inside a list, between call objects
    OBJECT = "object"  # inside a call object
    NAME = "name"  # a name before name_args
    ARGS = "args"  # the arguments object after name_args
    AFTER = "after"  # after the calls: an optional closing marker


class MarkedJsonParser(StreamingCallParser):
    """Calls as JSON after a marker: a list of call objects, one call object, or ``name[ARGS]{...}``."""

    def __init__(
        self,
        plan: ToolPlan,
        opens: tuple[str, ...],
        close: str | None = None,
        name_args: str | None = None,
        make_id: Any = None,
    ) -> None:
        super().__init__(CallWriter(plan, make_id) if make_id else CallWriter(plan), _State.CONTENT)
        self.opens, self.close, self.name_args = opens, close, name_args
        self._in_list = False
        self._obj: CallObject | None = None
        self._extent: Extent | None = None
        self._call: OpenCall | None = None

    def steps(self) -> dict[Any, Callable[[], bool]]:
        return {
            _State.CONTENT: self._content,
            _State.BODY: self._body,
            _State.LIST: self._list,
            _State.OBJECT: self._object,
            _State.NAME: self._name,
            _State.ARGS: self._args,
            _State.AFTER: self._after,
        }

    def _skip_space(self, chars: str = " \t\r\n") -> str:
        rest = self._rest
        head = rest.lstrip(chars)
        self._pos += len(rest) - len(head)
        return head

    # -- states (each returns whether it made progress) ----------------------------------------------------------
    def _content(self) -> bool:
        rest = self._rest
        at, marker = first_of(rest, self.opens)
        if marker is not None:
            self.out.text(rest[:at])
            self._pos += at + len(marker)
            self._state = _State.BODY
            return True
        keep = 0 if self._final else partial_suffix(rest, self.opens)
        self.out.text(rest[: len(rest) - keep])
        self._pos += len(rest) - keep
        return False

    def _body(self) -> bool:
        head = self._skip_space()
        if not head:
            return False
        if head.startswith("["):
            self._pos += 1
            self._in_list, self._state = True, _State.LIST
        elif head.startswith("{"):
            self._in_list = False
            self._begin_object()
        elif self.name_args is not None:
            self._state = _State.NAME
        else:
            self._state = _State.CONTENT  # NOTE: a marker before no call: the text goes on
        return True

    def _list(self) -> bool:
        head = self._skip_space(" \t\r\n,")
        if not head:
            return False
        if head.startswith("{"):
            self._begin_object()
        elif head.startswith("]"):
            self._pos += 1
            self._state = _State.AFTER
        else:
            self._state = _State.CONTENT
        return True

    def _begin_object(self) -> None:
        self._obj, self._call, self._state = CallObject(), None, _State.OBJECT

    def _object(self) -> bool:
        obj = self._obj
        assert obj is not None
        self._pos += obj.feed(self._rest)
        if self._call is None and obj.name is not None:
            self._call = self.out.open(obj.name)
        if self._call is not None:
            self.out.arguments(self._call, obj.arguments()[len(self._call.arguments) :])
        if obj.closed and self._call is not None:
            self.out.close(self._call)
            self._state = _State.LIST if self._in_list else _State.AFTER
            return True
        if obj.invalid or obj.closed or self._final:
            self._state = _State.CONTENT  # NOTE: a broken call stays incomplete; the rest is text
            return True
        return False

    def _name(self) -> bool:
        rest = self._rest
        assert self.name_args is not None
        at = rest.find(self.name_args)
        name = (rest[:at] if at >= 0 else rest[: len(rest) - partial_suffix(rest, (self.name_args,))]).strip()
        if not name.isidentifier() and not all(c.isalnum() or c in "_-." for c in name):
            self._state = _State.CONTENT
            return True
        if at < 0:
            if self._final:
                self._state = _State.CONTENT
                return True
            return False
        self._pos += at + len(self.name_args)
        self._call, self._extent, self._state = self.out.open(name), Extent(), _State.ARGS
        return True

    def _args(self) -> bool:
        extent, call = self._extent, self._call
        assert extent is not None and call is not None
        if not extent.started:
            head = self._skip_space()
            if head and head[0] not in "{[" or not head and self._final:
                self._state = _State.CONTENT  # NOTE: no arguments object: the call stays incomplete
                return True
        taken = extent.feed(self._rest)
        self.out.arguments(call, self._rest[:taken])
        self._pos += taken
        if extent.done:
            self.out.close(call)
            self._state = _State.AFTER
            return True
        if self._final:
            self._state = _State.CONTENT
            return True
        return False

    def _after(self) -> bool:
        if self.close is None:
            self._state = _State.CONTENT
            return True
        head = self._skip_space()
        if not self._final and (not head or self.close.startswith(head)):
            return False
        if head.startswith(self.close):
            self._pos += len(self.close)
        self._state = _State.CONTENT
        return True
