"""``--tool-call-parser qwen3_coder``: Qwen3-Coder's XML-style calls, as its chat template writes them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after its tag and one before ``</parameter>`` are
the template's); it becomes JSON by the type the tool's schema gives the parameter (a string
stays text; numbers, booleans, objects and arrays are read as JSON, or Python literals).
The arguments stream one parameter at a time: the header at ``<function=…>``, then
``{"city": "Paris"``, ``, "unit": "C"`` and ``}`` as each parameter and the function close.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.server.entrypoints.openai.markers import first_of, partial_suffix
from pagedllm.server.entrypoints.openai.tool_call_writer import CallWriter, OpenCall, StreamingCallParser

if TYPE_CHECKING:
    from pagedllm.server.entrypoints.openai.tool_calls import ToolPlan

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"


class Qwen3CoderParser(StreamingCallParser):
    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(CallWriter(plan), "content")
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in plan.tools}
        self._call: OpenCall | None = None
        self._parameter: str | None = None

    def steps(self) -> dict[Any, Callable[[], bool]]:
        return {
            "content": self._content,
            "function": self._function,
            "parameters": self._parameters,
            "value": self._value,
            "after": self._after,
        }

    def _head(self) -> str:
        rest = self._rest
        head = rest.lstrip()
        self._pos += len(rest) - len(head)
        return head

    def _waits(self, head: str, *tags: str) -> bool:
        return not self._final and (not head or any(t.startswith(head) for t in tags))

    # -- states (each returns whether it made progress) ------------------------------------------------------
    def _content(self) -> bool:
        rest = self._rest
        at, tag = first_of(rest, (CALL_OPEN,))
        if tag is not None:
            self.out.text(rest[:at])
            self._pos += at + len(tag)
            self._state = "function"
            return True
        keep = 0 if self._final else partial_suffix(rest, (CALL_OPEN,))
        self.out.text(rest[: len(rest) - keep])
        self._pos += len(rest) - keep
        return False

    def _function(self) -> bool:
        head = self._head()
        if self._waits(head, FUNCTION_OPEN):
            return False
        end = head.find(">")
        if not head.startswith(FUNCTION_OPEN) or end < 0 and self._final:
            self._state = "content"  # NOTE: <tool_call> before no function: the text goes on
            return True
        if end < 0:
            return False
        self._call = self.out.open(head[len(FUNCTION_OPEN) : end].strip())
        self._pos += end + 1
        self._state = "parameters"
        return True

    def _parameters(self) -> bool:
        head = self._head()
        call = self._call
        assert call is not None
        if head.startswith(FUNCTION_CLOSE):
            self.out.arguments(call, "}" if call.arguments else "{}")
            self.out.close(call)
            self._pos += len(FUNCTION_CLOSE)
            self._state = "after"
            return True
        if self._waits(head, FUNCTION_CLOSE, PARAMETER_OPEN):
            return False
        end = head.find(">")
        if head.startswith(PARAMETER_OPEN) and end >= 0:
            self._parameter = head[len(PARAMETER_OPEN) : end].strip()
            self._pos += end + 1
            self._state = "value"
            return True
        if head.startswith(PARAMETER_OPEN) and not self._final:
            return False
        self._state = "content"  # NOTE: broken: the call stays incomplete, and the rest is text
        return True

    def _value(self) -> bool:
        rest = self._rest
        # NOTE: a model that leaves out </parameter> goes on with the next tag; that ends the value too
        at, tag = first_of(rest, (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE))
        if tag is None and not self._final:
            return False
        raw = rest[:at] if tag is not None else rest
        self._pos += at + (len(tag) if tag == PARAMETER_CLOSE else 0) if tag is not None else len(rest)
        self._add_parameter(raw)
        self._state = "parameters"
        return True

    def _after(self) -> bool:
        head = self._head()
        if self._waits(head, CALL_CLOSE):
            return False
        if head.startswith(CALL_CLOSE):
            self._pos += len(CALL_CLOSE)
        self._state = "content"
        return True

    def _add_parameter(self, raw: str) -> None:
        call, name = self._call, self._parameter
        assert call is not None and name is not None
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        schema = (self._schemas.get(call.name, {}).get("properties") or {}).get(name)
        value = json.dumps(typed_value(raw, schema), ensure_ascii=False)
        self.out.arguments(call, f"{', ' if call.arguments else '{'}{json.dumps(name, ensure_ascii=False)}: {value}")


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's ``type`` asks for; text when it cannot be one."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if not kinds - {None} or "string" in kinds:
        return raw
    text = raw.strip()
    if "null" in kinds and text.lower() in ("null", "none"):
        return None
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, tuple):
            value = list(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        return value
    return raw
