"""Prompt-lookup proposals: what followed the latest earlier occurrence of the sequence's last n tokens.

::

    tokens:  x  a  b  c  d  e  y  a  b  c         last 3 tokens "a b c" occurred ending at 3
             0  1  2  3  4  5  6  7  8  9         proposals: tokens[4:] = d e y a ...

When the earlier occurrence ends right before the suffix (a loop of period p), the
proposals run on past the end of the list by repeating the period::

    tokens:  ... u v w u v w          "u v w" last seen ending p = 3 positions earlier
    proposals:   u v w u ...          tokens[end + 1 + i], wrapping every p
"""

from __future__ import annotations


class NgramIndex:
    """The latest end position of every n-gram (``min_n <= n <= max_n``) of one growing token list.

    NOTE: a sequence's tokens only ever grow at the end, so the index is extended by the
    positions added since the last call: each token is indexed once.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def propose(self, tokens: list[int], num: int) -> list[int]:
        """Up to ``num`` tokens that followed the longest suffix seen before (none if no suffix was).

        NOTE: a shorter match is weaker evidence: a suffix of n < ``max_n`` tokens proposes at
        most n. Text with nothing to copy still repeats single tokens now and then, and those
        matches then cost one verified token, not ``num``; loops and copied passages match at
        ``max_n`` and propose in full.
        """
        size = len(tokens)
        if num <= 0 or size < self.min_n + 1:
            return []
        self._extend(tokens, size - 1)  # NOTE: not the suffix itself: it would always match
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[size - n :]))
            if end is not None:
                return _continuation(tokens, end, num if n == self.max_n else min(num, n))
        return []

    def _extend(self, tokens: list[int], upto: int) -> None:
        ends, low, high = self._ends, self.min_n, self.max_n
        for end in range(self._indexed, upto):
            for n in range(low, min(high, end + 1) + 1):
                ends[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, upto)


def _continuation(tokens: list[int], end: int, num: int) -> list[int]:
    """``num`` tokens after position ``end``, repeating the period ``len(tokens) - 1 - end`` past the list."""
    size, out = len(tokens), list[int]()
    period = size - 1 - end
    for i in range(num):
        out.append(tokens[end + 1 + i] if end + 1 + i < size else out[i - period])
    return out
