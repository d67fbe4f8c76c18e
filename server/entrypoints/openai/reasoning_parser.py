"""Reasoning read out of a choice's text, as it grows: ``--reasoning-parser NAME``, vLLM's names.

A reasoning model thinks before it answers, in a block its chat template knows::

    <think>
    The user wants the weather in Paris.
    </think>

    It is sunny.
    └─ reasoning_content ─┘ ... └─ content ─┘

:class:`ReasoningParser` splits the text into the reasoning and the answer; only the answer
goes on to the tool-call parser and into ``content``. Where the output begins is read from
the prompt the template rendered: a template that opens the block itself (DeepSeek-R1-0528,
Qwen3-Thinking-2507: the prompt ends in ``<think>\\n``) leaves the model inside the reasoning,
so only ``</think>`` appears in the output; one that closes an empty block
(Qwen3 with ``enable_thinking=false``: ``<think>\\n\\n</think>\\n\\n``) turned thinking off.

Formats (from the models' published chat templates and model cards):

- ``deepseek_r1``: ``<think>…</think>``; DeepSeek-R1 always thinks, so text before
  ``</think>`` is reasoning even when ``<think>`` appears in neither prompt nor output.
- ``qwen3``: ``<think>…</think>``; Qwen3 thinks only when its output (or the prompt) opens
  the block, so text without one is all answer.
- ``deepseek_v3``: DeepSeek-V3.1, whose template ends the prompt in ``<think>`` when
  ``chat_template_kwargs`` ask for ``thinking`` and in ``</think>`` when not.
- ``glm45``: GLM-4.5, which writes ``<think>…</think>`` and whose template closes an empty
  ``<think></think>`` when ``enable_thinking`` is false.
- ``granite``: IBM Granite 3.2 with ``thinking=True``: ``Here is my thought process:`` …
  ``Here is my response:`` (also written ``Here's``).
- ``mistral``: Magistral (tokenizer v13 and later): ``[THINK]…[/THINK]``, special tokens; the
  model thinks when its system prompt asks it to, so text without ``[THINK]`` is all answer.
- ``openai_gptoss``: gpt-oss's harmony messages (:mod:`.harmony`): ``analysis`` is the reasoning.

NOTE: a block the model never closed (cut off by ``max_tokens``) is reasoning to its end, in
a stream and in a whole reply alike: a stream cannot take back what it sent as reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.server.entrypoints.openai.harmony import FINAL_HEADERS, HarmonyReasoningParser
from pagedllm.server.entrypoints.openai.markers import first_of, partial_suffix
from pagedllm.server.sampling_params import ReasoningMarkers


class SplitDelta(Protocol):
    reasoning: str
    content: str


class ReasoningReader(Protocol):
    """What a choice's text is read with to take its reasoning apart (see :class:`ReasoningParser`)."""

    reasoning: str
    content: str
    reasoning_end: int | None

    @property
    def in_reasoning(self) -> bool: ...

    def feed(self, text: str, final: bool = False) -> SplitDelta: ...

    def finish(self) -> SplitDelta: ...

    def reasoning_chars(self) -> int: ...


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its reasoning."""

    name: str
    starts: tuple[str, ...]
    """Texts that open the reasoning (any one)."""
    ends: tuple[str, ...]
    """Texts that close it and begin the answer (any one)."""
    always_thinks: bool
    """The output begins inside the reasoning unless the prompt turned thinking off."""
    needs_special_tokens: bool = False
    """Its markers are special tokens: the request's text must keep them."""

    def parser(self, prompt: str | None) -> ReasoningReader:
        """A parser for one choice of a request whose prompt text is ``prompt``."""
        return ReasoningParser(self, self.opening(prompt or ""))

    def markers(self, prompt: str | None) -> ReasoningMarkers:
        """The markers a grammar waits behind, for a request whose prompt text is ``prompt``."""
        return ReasoningMarkers(self.starts, self.ends, self.opening(prompt or ""))

    def opening(self, prompt: str) -> str:
        """Where the output begins: ``reasoning``, ``answer``, or ``either`` (the output says)."""
        start = max((prompt.rfind(s) for s in self.starts), default=-1)
        end = max((prompt.rfind(e) for e in self.ends), default=-1)
        if start > end:
            return "reasoning"  # NOTE: the template opened the block for the model
        if end >= 0 and prompt.rstrip().endswith(self.ends):
            return "answer"  # NOTE: the template closed an empty block: thinking is off
        return "reasoning" if self.always_thinks else "either"


THINK = ("<think>",), ("</think>",)
GRANITE = (
    ("Here is my thought process:", "Here's my thought process:"),
    ("Here is my response:", "Here's my response:"),
)


@dataclass(frozen=True)
class HarmonyFormat(ReasoningFormat):
    """gpt-oss's harmony messages: read by :class:`~.harmony.HarmonyReasoningParser`."""

    def parser(self, prompt: str | None) -> ReasoningReader:
        return HarmonyReasoningParser()

    def markers(self, prompt: str | None) -> ReasoningMarkers:
        return ReasoningMarkers((), self.ends, "reasoning")  # NOTE: gpt-oss reasons before any answer


FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", *THINK, always_thinks=True),
    "qwen3": ReasoningFormat("qwen3", *THINK, always_thinks=False),
    "deepseek_v3": ReasoningFormat("deepseek_v3", *THINK, always_thinks=False),
    "glm45": ReasoningFormat("glm45", *THINK, always_thinks=False),
    "granite": ReasoningFormat("granite", *GRANITE, always_thinks=False),
    "mistral": ReasoningFormat("mistral", ("[THINK]",), ("[/THINK]",), always_thinks=False, needs_special_tokens=True),
    "openai_gptoss": HarmonyFormat("openai_gptoss", (), FINAL_HEADERS, always_thinks=True, needs_special_tokens=True),
}
REASONING_PARSERS = tuple(FORMATS)
"""The names ``--reasoning-parser`` takes."""


@dataclass
class ReasoningDelta:
    """What a piece of text added to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


@dataclass
class ReasoningParser:
    """One choice's text, fed as it grows (:meth:`feed`), split into reasoning and answer.

    Whitespace around the reasoning and at the start of the answer is dropped (the newlines
    templates put after ``<think>`` and ``</think>``); text that may be a tag arriving is
    held back until the next piece tells.
    """

    fmt: ReasoningFormat
    state: str
    """``either`` (nothing read yet), ``reasoning`` or ``answer``."""
    reasoning: str = ""
    """The reasoning read so far."""
    content: str = ""
    """The answer read so far."""
    reasoning_end: int | None = None
    """Characters of the text up to the end of the reasoning (its closing tag), once it closed."""
    _text: str = ""
    _pos: int = 0  # NOTE: self._text[:self._pos] has been read
    _pending_space: str = field(default="", repr=False)
    _started: bool = False  # the reasoning has non-whitespace text

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        """Read ``text`` (what the choice's text gained); ``final``: the choice ended with it."""
        self._text += text
        delta = ReasoningDelta()
        while self._step(delta, final):
            pass
        return delta

    def finish(self) -> ReasoningDelta:
        return self.feed("", final=True)

    def reasoning_chars(self) -> int:
        """Characters of the text that belong to the reasoning (all of it while the block is open)."""
        if self.reasoning_end is not None:
            return self.reasoning_end
        return len(self._text) if self.state == "reasoning" else 0

    # -- states (each returns whether to read on) ------------------------------------------------------
    def _step(self, delta: ReasoningDelta, final: bool) -> bool:
        if self.state == "answer":
            self._answer(delta, self._text[self._pos :])
            self._pos = len(self._text)
            return False
        rest = self._text[self._pos :]
        head = rest.lstrip()
        opened = next((s for s in self.fmt.starts if head.startswith(s)), None)
        if not self._started and opened is not None:
            self._pos += len(rest) - len(head) + len(opened)  # NOTE: an opening tag the model wrote itself
            self.state = "reasoning"
            return True
        if not self._started and not final and (not head or any(s.startswith(head) for s in self.fmt.starts)):
            return False
        if self.state == "either":
            self.state = "answer"
            return True
        return self._reasoning(delta, rest, final)

    def _reasoning(self, delta: ReasoningDelta, rest: str, final: bool) -> bool:
        at, tag = first_of(rest, self.fmt.ends)
        if tag is not None:
            self._think(delta, rest[:at], closing=True)
            self._pos += at + len(tag)
            self.reasoning_end, self.state = self._pos, "answer"
            return True
        keep = 0 if final else partial_suffix(rest, self.fmt.ends)
        self._think(delta, rest[: len(rest) - keep], closing=final)
        self._pos += len(rest) - keep
        return False

    def _think(self, delta: ReasoningDelta, text: str, closing: bool) -> None:
        if not self._started:
            text = text.lstrip()
        text = self._pending_space + text
        body = text.rstrip()  # NOTE: trailing whitespace waits: it is sent only if more reasoning follows
        self._pending_space = "" if closing else text[len(body) :]
        if body:
            self._started = True
            self.reasoning += body
            delta.reasoning += body

    def _answer(self, delta: ReasoningDelta, text: str) -> None:
        if not self.content and self.reasoning_end is not None:
            text = text.lstrip()  # NOTE: the blank line templates put after the reasoning
        self.content += text
        delta.content += text


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    return FORMATS[name] if name is not None else None


def count_tokens(tokenizer: Any, token_ids: list[int], chars: int) -> int:
    """How many of ``token_ids`` it takes to write the first ``chars`` characters of their text.

    NOTE: a binary search over decoded prefixes, so a tag split over several tokens (a byte-level
    vocabulary) is counted whole, as is a single-token ``</think>``.
    """
    if chars <= 0 or tokenizer is None:
        return 0
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(token_ids[: mid + 1], skip_special_tokens=True)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return min(lo + 1, len(token_ids))
