"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

The engine raises :class:`ConfigError` naming its own field; :func:`from_config_error`
shows it under the request's parameter name (``prompt_token_ids`` -> ``prompt``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pagedllm.server.config import ConfigError

RETRY_AFTER_S = 1
ENGINE_FIELD_PARAMS = {"prompt_token_ids": "prompt", "lora_request": "model"}
"""Engine fields a request parameter of another name stands for, on every endpoint."""


class APIError(Exception):
    """An error the client sees in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def internal_error(message: str) -> APIError:
    return APIError(500, message, type="internal_server_error")


def from_config_error(error: ConfigError, params: Mapping[str, str] = {}) -> APIError:
    """A 400 for an engine rejection, naming the request parameter ``params`` maps its field to."""
    param = params.get(error.field) or ENGINE_FIELD_PARAMS.get(error.field, error.field)
    return bad_request(error.renamed(param).message, param)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 that names the field and the value given."""
    errors = exc.errors()
    if not errors:
        return bad_request("the request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return bad_request(
            f"the request body is not valid JSON: {first.get('msg')}" + (f" ({detail})" if detail else "")
        )
    # NOTE: a value failing every member of a union (prompt: str | list[str] | ...) gives one error per
    # member, their locations ending in the member's type; the field is their common prefix.
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]]
    loc = _common_prefix([tuple(e.get("loc", ())) for e in same_field])
    param = ".".join(str(p) for p in loc if p != "body") or None
    if first.get("type") == "missing":
        return bad_request(f"{param or 'body'} is required", param)
    # NOTE: a union member's error sits one level below the field; its input is the field's value.
    value = next((e.get("input") for e in same_field if len(e.get("loc", ())) == len(loc) + 1), first.get("input"))
    shown = repr(value) if len(repr(value)) <= 200 else repr(value)[:200] + "..."
    messages = sorted({e.get("msg", "") for e in same_field})
    return bad_request(f"{param or 'body'}={shown} is invalid: {'; or '.join(messages)}", param)


def _common_prefix(locs: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix
