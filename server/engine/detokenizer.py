"""Incremental detokenization: each new token adds text without decoding the whole output."""

from __future__ import annotations


def decode_new_text(
    tokenizer, ids: list[int], start: int, prefix_offset: int, read_offset: int, skip_special_tokens: bool
) -> tuple[str, int, int]:
    """Text added by the newest tokens, and the (prefix, read) offsets that follow.

    ``ids``: the sequence's tokens from position ``start`` (at most ``prefix_offset``) to its end,
    the newest included; offsets are positions in the whole sequence.

    NOTE: byte-level tokenizers can end a token mid-character. The text of the window
    ``[prefix_offset, read_offset)`` is subtracted from that of ``[prefix_offset, end)``;
    while the result ends in U+FFFD (an incomplete character), nothing is emitted and the
    offsets stay, so the character comes out whole once its last byte arrives.
    """
    window = ids[prefix_offset - start :]
    prefix = tokenizer.decode(window[: read_offset - prefix_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        return full[len(prefix) :], read_offset, start + len(ids)
    return "", prefix_offset, read_offset
