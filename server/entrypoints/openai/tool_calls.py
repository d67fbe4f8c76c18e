"""Tool calling on chat: ``tools`` and ``tool_choice`` as OpenAI defines them.

- ``none``: the tools are shown to the chat template, the model answers in text.
- a named function or ``required``: the arguments are generated under that function's JSON
  schema (``required``: an object naming one of the functions and its arguments), so they
  always parse and match.
- ``auto`` (the default when tools are given): the model decides; its text is parsed for
  the common formats: Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  and LLaMA-3's bare ``{"name": ..., "parameters": ...}``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.server.entrypoints.openai.errors import bad_request
from pagedllm.server.sampling_params import GuidedDecodingParams

HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """How one request treats its tools."""

    tools: list[dict[str, Any]]
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools or None

    def guided(self) -> GuidedDecodingParams | None:
        """The grammar that enforces the call (named / required), else None."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            assert self.named is not None
            return GuidedDecodingParams(json=schemas[self.named])
        if self.mode == "required":
            options = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": schema},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, schema in schemas.items()
            ]
            return GuidedDecodingParams(json={"anyOf": options})
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished completion."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            value = json.loads(text)
            return None, [ToolCall(value["name"], json.dumps(value["arguments"]))]
        if self.mode == "auto":
            return self._parse_auto(text)
        return text, []

    def _parse_auto(self, text: str) -> tuple[str | None, list[ToolCall]]:
        known = {t["function"]["name"] for t in self.tools}
        calls = [c for c in (_call(m) for m in HERMES.findall(text)) if c and c.name in known]
        if calls:
            rest = HERMES.sub("", text).strip()
            return rest or None, calls
        bare = text.strip().removeprefix("<|python_tag|>").strip()
        call = _call(bare) if bare.startswith("{") else None
        if call is not None and call.name in known:
            return None, [call]
        return text, []

    def may_be_call(self, text: str) -> bool:
        """Whether streamed text could still turn into a tool call (so it is held back)."""
        head = text.lstrip().removeprefix("<|python_tag|>").lstrip()
        return self.mode == "auto" and (head == "" or head.startswith(("{", "<tool_call>", "<tool_call"[: len(head)])))


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice``; None when the request uses no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools: give the functions the model may call", "tool_choice")
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise bad_request(
                f"tools[{i}] is invalid: give {{'type': 'function', 'function': {{'name': ...}}}}", "tools"
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    names = [t["function"]["name"] for t in tools]
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not among the tools {names}", "tool_choice"
            )
        return ToolPlan(tools, "named", name)
    if choice not in ("none", "auto", "required"):
        raise bad_request(
            f"tool_choice={choice!r} is not allowed: none, auto, required or a named function", "tool_choice"
        )
    return ToolPlan(tools, choice)
