"""A tool call's JSON object, ``{"name": ..., "arguments": {...}}``, read as its characters arrive.

Only the object's top level is followed: the ``name`` once its string is closed, and the
raw text of the arguments value (``arguments``, or LLaMA-3's ``parameters``) while it grows,
so a stream can send the arguments before the object is complete::

    {"name": "get_weather", "arguments": {"city": "Pa      <- read so far
              └── name ──┘               └ arguments ┘    (raw text, sent as it grows)

The raw text is what the model wrote, so the fragments a stream sends add up to exactly
the arguments a non-streamed reply carries.
"""

from __future__ import annotations

import enum
import json

ARGUMENT_KEYS = ("arguments", "parameters")


class _Phase(enum.Enum):
    START = "start"  # before the opening brace
    KEY = "key"  # expecting a key or the closing brace
    IN_KEY = "in_key"
    COLON = "colon"
    VALUE = "value"  # expecting a value
    IN_VALUE = "in_value"
    AFTER_VALUE = "after_value"  # expecting a comma or the closing brace
    CLOSED = "closed"
    INVALID = "invalid"


class CallObject:
    """One call object, fed its text piece by piece (:meth:`feed`)."""

    def __init__(self) -> None:
        self.name: str | None = None
        """The ``name`` value, once its string is closed."""
        self._phase = _Phase.START
        self._key = ""  # raw text of the key being read, then of the key whose value is read
        self._value = ""  # raw text of the value being read
        self._depth = 0  # nesting inside the value being read
        self._in_string = False
        self._escape = False
        self._arguments_key: str | None = None
        self._arguments: str | None = None  # the arguments value's raw text, once complete

    @property
    def closed(self) -> bool:
        """The object's closing brace was read."""
        return self._phase is _Phase.CLOSED

    @property
    def invalid(self) -> bool:
        """The text is not a call object (not an object, broken JSON, or a name that is not a string)."""
        return self._phase is _Phase.INVALID

    def arguments(self) -> str:
        """The arguments as far as they can be sent: the raw JSON read so far (a string value:
        its text, once complete). ``{}`` for a closed object without arguments."""
        if self._arguments is not None:
            return _as_arguments(self._arguments)
        if self._phase is _Phase.IN_VALUE and self._reading_arguments() and not self._value.startswith('"'):
            return self._value
        return "{}" if self.closed else ""

    def feed(self, text: str) -> int:
        """Read ``text`` up to the object's end; returns how many characters belong to the object."""
        for i, ch in enumerate(text):
            if self._phase is _Phase.CLOSED or self._phase is _Phase.INVALID:
                return i
            self._read(ch)
        return len(text)

    # -- one character ------------------------------------------------------------------------------
    def _read(self, ch: str) -> None:
        phase = self._phase
        if phase is _Phase.IN_VALUE:
            if self._value_char(ch):
                return
            phase = self._phase  # NOTE: a scalar ended at ch, which now closes or separates
        if phase is _Phase.IN_KEY:
            self._key_char(ch)
        elif ch.isspace():
            return
        elif phase is _Phase.START:
            self._expect(ch == "{", _Phase.KEY)
        elif phase is _Phase.KEY:
            self._key = ""
            self._phase = _Phase.IN_KEY if ch == '"' else _Phase.CLOSED if ch == "}" else _Phase.INVALID
        elif phase is _Phase.COLON:
            self._expect(ch == ":", _Phase.VALUE)
        elif phase is _Phase.VALUE:
            self._start_value(ch)
        elif phase is _Phase.AFTER_VALUE:
            self._phase = _Phase.KEY if ch == "," else _Phase.CLOSED if ch == "}" else _Phase.INVALID

    def _expect(self, ok: bool, then: _Phase) -> None:
        self._phase = then if ok else _Phase.INVALID

    def _key_char(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._phase = _Phase.COLON
            return
        self._key += ch

    def _start_value(self, ch: str) -> None:
        if ch in ",}]:":
            self._phase = _Phase.INVALID
            return
        self._phase, self._value, self._depth = _Phase.IN_VALUE, "", 0
        self._value_char(ch)

    def _value_char(self, ch: str) -> bool:
        """Add ``ch`` to the value; False when it is not part of it (it ends a scalar)."""
        if self._in_string:
            self._value += ch
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 0:
                    self._end_value()
            return True
        if self._depth == 0 and self._value and (ch in ",}]" or ch.isspace()):
            self._end_value()
            return False
        self._value += ch
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()
        return True

    def _end_value(self) -> None:
        ok, value = _loads(self._value)
        key = _decode_key(self._key)
        if not ok or (key == "name" and self.name is None and not isinstance(value, str)):
            self._phase = _Phase.INVALID
            return
        self._phase = _Phase.AFTER_VALUE
        if key == "name" and self.name is None:
            self.name = value  # type: ignore[assignment]
        elif self._reading_arguments(key):
            self._arguments_key, self._arguments = key, self._value

    def _reading_arguments(self, key: str | None = None) -> bool:
        key = key if key is not None else _decode_key(self._key)
        return key in ARGUMENT_KEYS and self._arguments_key in (None, key) and self._arguments is None


def _decode_key(raw: str) -> str:
    ok, value = _loads(f'"{raw}"')
    return value if ok and isinstance(value, str) else raw


def _loads(text: str) -> tuple[bool, object]:
    """(whether ``text`` is JSON, its value)."""
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def _as_arguments(raw: str) -> str:
    """Arguments given as a JSON string (some models quote them) are that string's text."""
    ok, value = _loads(raw)
    return value if ok and isinstance(value, str) else raw
