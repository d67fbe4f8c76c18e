"""The error every configuration check raises, and the checks themselves.

Each edge (a CLI flag, a ``spec.`` path of the custom resource, an OpenAI request
parameter) shows a :class:`ConfigError` under its own name for the field it carries.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """A value outside what is allowed, carrying the field it is about as data.

    ``field`` is the engine's own name (``block_size``, ``best_of``, ``prompt_token_ids``).
    Each edge shows the error under its own name for that field with :meth:`renamed`:
    the CLI as ``--block-size``, the operator as ``spec.blockSize``, the HTTP API as the
    OpenAI ``param``. Nothing parses the message to find the field.
    """

    def __init__(
        self,
        field: str,
        value: Any,
        allowed: str = "",
        *,
        problem: str = "is not allowed",
        subject: str | None = None,
        name: str | None = None,
    ) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.problem = problem
        self.subject = subject
        """How the value is shown when ``name=value`` would read badly, with ``{name}`` for the name."""
        self.name = name or field
        super().__init__(self.message)

    @property
    def message(self) -> str:
        shown = self.subject.format(name=self.name) if self.subject else f"{self.name}={self.value!r}"
        head = " ".join(part for part in (shown, self.problem) if part)
        return f"{head}: {self.allowed}" if self.allowed else head

    def renamed(self, name: str) -> ConfigError:
        """The same error, shown under ``name`` (a flag, a spec path, a request parameter)."""
        return ConfigError(self.field, self.value, self.allowed, problem=self.problem, subject=self.subject, name=name)

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: keyword-only arguments are not in ``args``: without this it cannot cross a process boundary.
        return _rebuild_config_error, (self.field, self.value, self.allowed, self.problem, self.subject, self.name)


def _rebuild_config_error(
    field: str, value: Any, allowed: str, problem: str, subject: str | None, name: str
) -> ConfigError:
    return ConfigError(field, value, allowed, problem=problem, subject=subject, name=name)


def field_help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


def check_range(name: str, value: Any, low: Any = None, high: Any = None, *, low_open: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is None or within the bounds."""
    if value is None:
        return
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        hi = "" if high is None else f"<= {high}"
        allowed = " and ".join(s for s in (lo, hi) if s)
        raise ConfigError(name, value, f"must be {allowed}", problem="is out of range")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(name, value, f"choose one of {list(choices)}")


def _check_json_type(name: str, value: Any, annotation: str) -> None:
    """Refuse a JSON value of another kind than the field's annotation (``"str | None"``) names."""
    allowed = annotation.split(" | ")
    if value is None:
        ok = "None" in allowed
    elif isinstance(value, bool):  # NOTE: before int, which bool is a subclass of
        ok = "bool" in allowed
    else:
        ok = any(isinstance(value, kind) for word, kind in (("int", int), ("str", str)) if word in allowed)
    if not ok:
        raise ConfigError(name, value, f"must be of type {annotation}", problem="has the wrong type")


def json_object(name: str, value: str | dict[str, Any], cls: type) -> dict[str, Any]:
    """A JSON-valued flag's keys, checked against the fields of ``cls``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(name, value, f"give a JSON object ({exc.msg})", problem="is not JSON") from exc
    if not isinstance(value, dict):
        raise ConfigError(name, value, "give a JSON object of the fields", problem="is not an object")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, item in value.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}", item, f"allowed are {sorted(known)}", problem="is an unknown key")
        _check_json_type(f"{name}.{key}", item, str(known[key].type))
    return value
