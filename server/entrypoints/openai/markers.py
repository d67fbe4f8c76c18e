"""Markers (tags such as ``<tool_call>`` or ``</think>``) looked for in text that arrives in pieces.

A piece may end inside a marker (``</th`` of ``</think>``): :func:`partial_suffix` says how
much of its end to hold back until the next piece tells whether the marker is arriving.
"""

from __future__ import annotations


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers`` (it may be one arriving)."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


def first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the first of ``markers`` occurs in ``text``, and which (-1 and None: none does)."""
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else (-1, None)
