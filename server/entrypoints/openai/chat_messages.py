"""A chat request's messages as a chat template reads them: plain dicts, text content, call arguments as objects."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.server.entrypoints.openai.errors import bad_request
from pagedllm.server.entrypoints.openai.protocol import ChatMessage


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as the template sees it (``role``, ``content`` text, calls, call id, name)."""
    plain: dict[str, Any] = {"role": message.role, "content": message_text(message)}
    if message.tool_calls:
        plain["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.tool_call_id:
        plain["tool_call_id"] = message.tool_call_id
    if message.name:
        plain["name"] = message.name
    return plain


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool call, with its arguments as an object (what chat templates expect)."""
    function = dict(call.get("function") or {})
    try:
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        pass
    return {**call, "function": function}


def message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise bad_request(f"content part type={part.type!r} is not supported: only 'text'", "messages")
        parts.append(part.text or "")
    return "".join(parts)
