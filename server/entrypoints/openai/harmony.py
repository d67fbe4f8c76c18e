"""OpenAI's harmony format (gpt-oss), read as the text arrives: ``--reasoning-parser openai_gptoss``.

gpt-oss answers in messages, each a header and a body (openai/harmony); the chat template's
generation prompt ends in ``<|start|>assistant``, so the output's first message has no
``<|start|>``::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

    <|channel|>analysis<|message|>Need the tool.<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(one line in the text; cut here to fit).

The recipient (``to=functions.NAME``) may also follow the channel
(``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>``).
``analysis`` is the reasoning, ``final`` the answer, ``commentary`` either a call (with a
recipient) or a preamble shown to the user (without). ``<|return|>`` and ``<|call|>`` are
gpt-oss's end-of-sequence tokens, so the text often ends without them.

:class:`HarmonyReader` cuts the text into message events; :class:`HarmonyReasoningParser`
splits them into reasoning and answer, passing each call message on unchanged, for
``--tool-call-parser openai`` (:mod:`.tool_format_harmony`) to read.

NOTE: the markers are special tokens: requests read in this format keep them in the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedllm.server.entrypoints.openai.markers import first_of, partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
FINAL_HEADERS = ("<|channel|>final<|message|>", "<|channel|>final <|constrain|>json<|message|>")
"""Texts after which gpt-oss writes its answer (the grammar of a structured output applies there)."""


@dataclass(frozen=True)
class Header:
    """A message's header: its channel and, for a call, its recipient."""

    channel: str | None
    recipient: str | None
    raw: str

    @classmethod
    def read(cls, raw: str) -> Header:
        channel = re.search(r"<\|channel\|>\s*([^\s<]+)", raw)
        recipient = re.search(r"\bto=([^\s<]+)", raw)
        return cls(channel and channel.group(1), recipient and recipient.group(1), raw)

    @property
    def kind(self) -> str:
        """``reasoning``, ``call`` (a recipient is named) or ``answer``."""
        if self.recipient is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "answer"


@dataclass
class Event:
    """One piece of the text: ``header`` (a message begins), ``body``, ``end`` (its end marker,
    ``""`` where the text ended), or ``text`` outside any message."""

    kind: str
    text: str = ""
    header: Header | None = None
    upto: int = 0
    """Characters of the whole text up to this event's end."""


@dataclass
class HarmonyReader:
    """Harmony text, fed as it grows, cut into :class:`Event` s; a marker arriving waits for the next piece."""

    _text: str = ""
    _pos: int = 0
    state: str = "between"
    """``between`` messages, in a ``header`` or in a ``body``."""
    header: Header | None = None
    """The header of the message being read."""

    @property
    def pos(self) -> int:
        """Characters of the text read so far."""
        return self._pos

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self._text += text
        events: list[Event] = []
        while getattr(self, f"_{self.state}")(events, final):
            pass
        return events

    def _emit(self, events: list[Event], kind: str, text: str, read: int | None = None) -> None:
        """Record an event and read past it (``read`` characters; default: its text)."""
        self._pos += len(text) if read is None else read
        events.append(Event(kind, text, self.header if kind != "text" else None, self._pos))

    def _between(self, events: list[Event], final: bool) -> bool:
        rest = self._text[self._pos :]
        at, marker = first_of(rest, (START, CHANNEL))
        if marker is None:
            at = len(rest) - (0 if final else partial_suffix(rest, (START, CHANNEL)))
        if rest[:at]:
            self._emit(events, "text", rest[:at])  # NOTE: text outside the format's messages
        if marker is not None:
            self.state = "header"
        return marker is not None

    def _header(self, events: list[Event], final: bool) -> bool:
        rest = self._text[self._pos :]
        at = rest.find(MESSAGE)
        if at < 0:
            if final and rest:
                self._emit(events, "text", rest)  # NOTE: a header cut off: its text is all there is
            return False
        self.header = Header.read(rest[:at])
        self._emit(events, "header", rest[: at + len(MESSAGE)])
        self.state = "body"
        return True

    def _body(self, events: list[Event], final: bool) -> bool:
        rest = self._text[self._pos :]
        at, end = first_of(rest, ENDS)
        upto = at if end is not None else len(rest) - (0 if final else partial_suffix(rest, ENDS))
        if rest[:upto]:
            self._emit(events, "body", rest[:upto])
        if end is None and not final:
            return False
        self._emit(events, "end", end or "")
        self.state = "between"
        return end is not None


@dataclass
class HarmonyDelta:
    reasoning: str = ""
    content: str = ""


@dataclass
class HarmonyReasoningParser:
    """The ``analysis`` messages as reasoning, ``final`` and preamble bodies as the answer, and each
    call message passed on whole (header, body, end marker) in the answer for the tool-call parser."""

    reader: HarmonyReader = field(default_factory=HarmonyReader)
    reasoning: str = ""
    content: str = ""
    reasoning_end: int | None = None
    """Characters of the text up to the end of the last reasoning message read."""

    @property
    def in_reasoning(self) -> bool:
        """Inside an analysis body (or before the first message: gpt-oss reasons first)."""
        header, state = self.reader.header, self.reader.state
        if header is None:
            return self.reasoning_end is None
        return state == "body" and header.kind == "reasoning"

    def feed(self, text: str, final: bool = False) -> HarmonyDelta:
        delta = HarmonyDelta()
        for event in self.reader.feed(text, final):
            self._take(event, delta)
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    def finish(self) -> HarmonyDelta:
        return self.feed("", final=True)

    def reasoning_chars(self) -> int:
        if self.in_reasoning and self.reader.header is not None:
            return self.reader.pos
        return self.reasoning_end or 0

    def _take(self, event: Event, delta: HarmonyDelta) -> None:
        kind = event.header.kind if event.header is not None else "answer"
        if kind == "call":
            delta.content += event.text  # NOTE: the call's own markers, for the tool-call parser
        elif event.kind == "header" and kind == "reasoning" and (self.reasoning or delta.reasoning):
            delta.reasoning += "\n\n"  # NOTE: one analysis message after another
        elif event.kind == "end" and kind == "reasoning":
            self.reasoning_end = event.upto
        elif event.kind in ("body", "text"):
            if kind == "reasoning":
                delta.reasoning += event.text
            else:
                delta.content += event.text
