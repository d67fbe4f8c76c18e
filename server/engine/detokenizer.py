"""Incremental detokenization: each new token adds text without decoding the whole output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def decode_new_text(
    decode: Callable[[list[int], bool], str],
    ids: list[int],
    start: int,
    prefix_offset: int,
    read_offset: int,
    skip_special_tokens: bool,
) -> tuple[str, int, int]:
    """Text added by the newest tokens, and the (prefix, read) offsets that follow.

    ``decode``: ``decode(ids, skip_special_tokens) -> text`` (:func:`text_decoder`).
    ``ids``: the sequence's tokens from position ``start`` (at most ``prefix_offset``) to its end,
    the newest included; offsets are positions in the whole sequence.

    NOTE: byte-level tokenizers can end a token mid-character. The text of the window
    ``[prefix_offset, read_offset)`` is subtracted from that of ``[prefix_offset, end)``;
    while the result ends in U+FFFD (an incomplete character), nothing is emitted and the
    offsets stay, so the character comes out whole once its last byte arrives.
    """
    window = ids[prefix_offset - start :]
    prefix = decode(window[: read_offset - prefix_offset], skip_special_tokens)
    full = decode(window, skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        return full[len(prefix) :], read_offset, start + len(ids)
    return "", prefix_offset, read_offset


def text_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` for ``tokenizer``: its own ``decode``, or, for a
    ``transformers`` fast tokenizer that overrides neither ``decode`` nor ``_decode``, its Rust
    backend's ``decode`` called directly.

    NOTE: the same text either way. ``transformers``' wrapper adds input conversion and, when
    ``clean_up_tokenization_spaces`` is set, a clean-up pass; the shortcut is taken only while
    that flag is off (read per call), and the wrapper's conversions are no-ops on a list of ints.
    It saves most of the per-token cost of incremental detokenization (two decodes a token).
    """
    backend = _plain_fast_backend(tokenizer)
    if backend is None:
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)

    def decode(ids: list[int], skip: bool) -> str:
        if tokenizer.clean_up_tokenization_spaces:
            return tokenizer.decode(ids, skip_special_tokens=skip)
        return backend.decode(ids, skip_special_tokens=skip)

    return decode


def _plain_fast_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when its decode path is transformers' own."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return getattr(tokenizer, "_tokenizer", None)
