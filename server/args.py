"""Command-line flags derived from the engine config fields.

``block_size`` becomes ``--block-size``, booleans get ``--x`` / ``--no-x``, choices
and help come from the field metadata. The operator renders its command line with
:func:`flag_for`, so the two can never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from pagedllm.server.config import ConfigError, EngineConfig, engine_fields


def flag_for(name: str) -> str:
    """The CLI flag of an engine field: ``block_size`` -> ``--block-size``."""
    return "--" + name.replace("_", "-")


def _base_type(f: dataclasses.Field) -> type:
    hint = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing))  # noqa: S307 (annotations only)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _optional_str(value: str):
    return None if value.lower() in ("none", "") else value


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per engine field to ``parser``."""
    group = parser.add_argument_group("engine")
    for f in engine_fields():
        meta = f.metadata
        kind = meta.get("flag_type") or _base_type(f)
        text = meta.get("help", "")
        # NOTE: a field whose help already says what happens when unset shows no "(default: None)".
        help_text = text if f.default is None and "default" in text.lower() else f"{text} (default: {f.default})"
        if kind is bool:
            group.add_argument(
                flag_for(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
            continue
        choices = meta.get("choices")
        if choices is not None and None in choices:
            group.add_argument(
                flag_for(f.name),
                dest=f.name,
                type=_optional_str,
                default=f.default,
                choices=list(choices),
                help=help_text,
            )
            continue
        group.add_argument(
            flag_for(f.name),
            dest=f.name,
            type=kind,
            default=f.default,
            choices=list(choices) if choices else None,
            help=help_text,
        )
    return parser


def engine_kwargs(namespace: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword arguments held by a parsed namespace (``serve MODEL``'s positional model in ``model``)."""
    kwargs = {f.name: getattr(namespace, f.name) for f in engine_fields()}
    tag = getattr(namespace, "model_tag", None)
    if tag is not None:
        if kwargs["model"] is not None and kwargs["model"] != tag:
            problem = f"differs from --model {kwargs['model']!r}"
            subject = f"the positional MODEL {tag!r}"
            raise ConfigError("model", tag, "give one model, as MODEL or --model", problem=problem, subject=subject)
        kwargs["model"] = tag
    return kwargs


def engine_config_from_args(namespace: argparse.Namespace) -> EngineConfig:
    """Validate parsed flags; a bad value raises :class:`ConfigError` shown under its flag."""
    try:
        return EngineConfig.from_kwargs(**engine_kwargs(namespace))
    except ConfigError as exc:
        raise as_flag_error(exc) from exc


def as_flag_error(error: ConfigError) -> ConfigError:
    """``error`` shown under the CLI flag of its engine field (``block_size`` -> ``--block-size``).

    A key inside a JSON-valued flag keeps its spelling: ``kv_events_config.topic`` -> ``--kv-events-config.topic``.
    """
    field, dot, key = error.field.partition(".")
    return error.renamed(flag_for(field) + dot + key)
