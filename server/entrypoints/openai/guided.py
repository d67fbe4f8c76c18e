"""Structured-output fields of a request (OpenAI's ``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) as one :class:`GuidedDecodingParams`, and ``logit_bias`` as token ids."""

from __future__ import annotations

from typing import Any

from pagedllm.server.config import ConfigError
from pagedllm.server.entrypoints.openai.errors import APIError, bad_request, from_config_error
from pagedllm.server.entrypoints.openai.protocol import SamplingFields
from pagedllm.server.sampling_params import GuidedDecodingParams

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def guided_decoding(req: SamplingFields) -> tuple[GuidedDecodingParams | None, str | None]:
    """The request's grammar and the parameter that asked for it (for errors), or (None, None)."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec:
            asked.append(("response_format", spec))
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field)
        if value is not None:
            asked.append((field, {key: value}))
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(STRUCTURED_KEYS))
        if unknown:
            raise bad_request(
                f"structured_outputs has unknown keys {unknown}: use one of {list(STRUCTURED_KEYS)}",
                "structured_outputs",
            )
        asked.append(("structured_outputs", dict(req.structured_outputs)))
    if not asked:
        return None, None
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise bad_request(f"{' and '.join(names)} each constrain the output: give only one", names[1])
    param, spec = asked[0]
    try:
        return GuidedDecodingParams(**spec), param
    except ConfigError as exc:
        raise from_config_error(exc, {"guided_decoding": param, "guided_choice": param}) from exc
    except TypeError as exc:
        raise bad_request(f"{param} is invalid: {exc}", param) from exc


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, (dict, str)):
            raise bad_request("response_format.json_schema.schema is required: give the JSON schema", "response_format")
        return {"json": schema}
    raise bad_request(
        f"response_format type={kind!r} is not allowed: use text, json_object or json_schema", "response_format"
    )


def logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string token ids as ints."""
    if not value:
        return None
    try:
        return {int(token): float(bias) for token, bias in value.items()}
    except ValueError as exc:
        raise APIError(400, f"logit_bias keys must be token ids: {exc}", param="logit_bias") from exc


def guided_param_names(req: SamplingFields) -> dict[str, str]:
    """Engine fields of a grammar that failed to compile -> the parameter the request used."""
    _, param = guided_decoding(req)
    return (
        {
            field: param
            for field in (
                "guided_json",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
                "response_format",
                "guided_decoding",
            )
        }
        if param
        else {}
    )
