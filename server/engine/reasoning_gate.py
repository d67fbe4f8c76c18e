"""A grammar that waits while a reasoning model thinks: structured outputs constrain the answer only.

A request with a grammar and :class:`~pagedllm.server.sampling_params.ReasoningMarkers` gets a
:class:`ReasoningGate` in place of a bare xgrammar matcher. It follows the output token by token::

    either ──first token the grammar accepts──────────────────────────▶ answer (masked)
      │
      └─first token of an opening text ("<think>")─▶ reasoning (free) ─end text seen─▶ answer
                                                     ▲
    reasoning (the prompt opened the block) ─────────┘

While the model reasons its rows are not masked and the matcher is not advanced; from the token
after the end text (``</think>``) the grammar applies as it would from the first token. In the
``either`` state the mask is the grammar's plus the first token of each opening text, and an
opening text that takes several tokens is then written out in full (the mask allows only its
next token).

NOTE: the grammar is preferred when it accepts the first token too (a byte vocabulary's ``<``):
a grammar that spells out the reasoning itself keeps constraining all of it.

NOTE: the end is found in the text of the last few tokens (decoded with special tokens), so an
end text the model spells with other tokens than the usual ones is still seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.server.sampling_params import ReasoningMarkers


@dataclass(frozen=True)
class MarkerTokens:
    """A request's reasoning markers as its tokenizer writes them."""

    starts: tuple[tuple[int, ...], ...]
    """Token ids of each opening text."""
    ends: tuple[str, ...]
    """End texts, looked for in the decoded tail of the reasoning."""
    opening: str
    """``reasoning``, ``answer`` or ``either`` (see :class:`ReasoningMarkers`)."""
    window: int
    """Tokens of the tail decoded to find an end text."""


def marker_tokens(markers: ReasoningMarkers, tokenizer: Any) -> MarkerTokens:
    """Tokenize the opening texts once per request."""
    starts = tuple(ids for s in markers.starts if (ids := tuple(tokenizer.encode(s, add_special_tokens=False))))
    longest = max(len(tokenizer.encode(e, add_special_tokens=False)) for e in markers.ends)
    return MarkerTokens(starts, markers.ends, markers.opening, 2 * longest + 4)


class ReasoningGate:
    """An xgrammar matcher behind a reasoning block; answers the matcher's calls the engine makes."""

    def __init__(self, matcher: Any, markers: MarkerTokens, tokenizer: Any) -> None:
        self.matcher = matcher
        self.markers = markers
        self.tokenizer = tokenizer
        self.state = markers.opening
        """``either``, ``reasoning`` or ``answer``."""
        self._forced: tuple[int, ...] = ()  # NOTE: the rest of an opening text being written
        self._tail: list[int] = []

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> bool:
        """Fill ``bitmask[row]`` with the tokens allowed next; False: any token is (the row is free)."""
        if self._forced:
            bitmask[row].zero_()
            _allow(bitmask, row, self._forced[0])
            return True
        if self.state == "reasoning":
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.state == "either":
            for ids in self.markers.starts:
                _allow(bitmask, row, ids[0])
        return True

    def accept_token(self, token: int) -> bool:
        """Follow one sampled token; False: the mask should not have allowed it."""
        if self._forced:
            if token != self._forced[0]:
                return False
            self._forced = self._forced[1:]
            return True
        if self.state == "answer":
            return bool(self.matcher.accept_token(token))
        if self.state == "either":
            return self._first(token)
        self._tail = [*self._tail, token][-self.markers.window :]
        text = self.tokenizer.decode(self._tail, skip_special_tokens=False)
        if any(end in text for end in self.markers.ends):
            self.state = "answer"
        return True

    def is_terminated(self) -> bool:
        return self.state == "answer" and bool(self.matcher.is_terminated())

    def _first(self, token: int) -> bool:
        if self.matcher.accept_token(token):
            self.state = "answer"
            return True
        opened = next((ids for ids in self.markers.starts if ids[0] == token), None)
        if opened is None:
            return False
        self.state, self._forced = "reasoning", opened[1:]
        return True


def _allow(bitmask: Any, row: int, token: int) -> None:
    """Set token's bit in an xgrammar bitmask (a CPU int32 tensor: bit j of word w is token 32 w + j)."""
    words = bitmask[row].numpy().view(np.uint32)
    words[token >> 5] |= np.uint32(1 << (token & 31))
