"""Tool calling on chat: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI defines them.

- ``none``: the tools are shown to the chat template, the model answers in text.
- a named function: the arguments are generated under that function's JSON schema, so they
  always parse and match.
- ``required``: a JSON list of calls is generated, each ``{"name": ..., "arguments": ...}``
  naming one of the functions with arguments under its schema (one call at most when
  ``parallel_tool_calls`` is false).
- ``auto`` (the default when tools are given): the model decides; its text is read in the
  format ``--tool-call-parser`` names (:mod:`.tool_formats`), by default the common ones:
  Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (any number, between
  text) and LLaMA-3's bare ``{"name": ..., "parameters": ...}``.
  With ``parallel_tool_calls`` false only the first call is kept.

Both streamed and whole replies read the model's text with the same parser
(:meth:`ToolPlan.parser`): for ``required`` and a named function always
:class:`~pagedllm.server.entrypoints.openai.tool_parser.ToolCallParser`, which reads the JSON
their grammar makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.server.entrypoints.openai.errors import bad_request
from pagedllm.server.entrypoints.openai.tool_call_writer import ToolCall
from pagedllm.server.entrypoints.openai.tool_formats import TOOL_FORMATS, CallParser, make_parser
from pagedllm.server.entrypoints.openai.tool_parser import ToolCallParser
from pagedllm.server.sampling_params import GuidedDecodingParams


@dataclass(frozen=True)
class ToolPlan:
    """How one request treats its tools."""

    tools: list[dict[str, Any]]
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    """``parallel_tool_calls``: false keeps at most one call per choice."""
    format: str | None = None
    """The ``--tool-call-parser`` format ``auto`` reads (None: Hermes and LLaMA-3 JSON)."""

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools or None

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read for tool calls (every mode but ``none``)."""
        return self.mode != "none"

    def parser(self) -> CallParser:
        """A parser for one choice's text."""
        if self.mode == "auto" and self.format is not None:
            return make_parser(self.format, self)
        return ToolCallParser(self)

    @property
    def needs_special_tokens(self) -> bool:
        """The format's markers are special tokens, which the text must keep to be read."""
        return self.mode == "auto" and self.format is not None and TOOL_FORMATS[self.format].needs_special_tokens

    def guided(self) -> GuidedDecodingParams | None:
        """The grammar that enforces the calls (named / required), else None."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            assert self.named is not None
            return GuidedDecodingParams(json=schemas[self.named])
        if self.mode == "required":
            one_call = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": schema},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, schema in schemas.items()
            ]
            calls: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}
            return GuidedDecodingParams(json=calls if self.parallel else {**calls, "maxItems": 1})
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished completion: its text when it holds no complete call."""
        if not self.reads_calls:
            return text, []
        parser = self.parser()
        parser.feed(text)
        parser.finish()
        if not parser.calls:
            return text, []
        return parser.content or None, parser.calls


def plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool = True,
    tool_format: str | None = None,
) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice``; None when the request uses no tools.

    ``tool_format``: the ``--tool-call-parser`` format ``auto`` reads (None: Hermes and LLaMA-3 JSON)."""
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
        return ToolPlan(tools, "named", name, parallel, tool_format)
    if choice not in ("none", "auto", "required"):
        raise bad_request(
            f"tool_choice={choice!r} is not allowed: none, auto, required or a named function", "tool_choice"
        )
    return ToolPlan(tools, choice, parallel=parallel, format=tool_format)
