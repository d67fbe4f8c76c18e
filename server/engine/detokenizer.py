"""Incremental detokenization: each new token adds text without decoding the whole output."""

from __future__ import annotations

from pagedllm.server.core.sequence import Sequence


def decode_new_text(tokenizer, seq: Sequence, skip_special_tokens: bool) -> str:
    """Text added by the sequence's newest tokens; advances its offsets.

    NOTE: byte-level tokenizers can end a token mid-character. The text of the window
    ``[prefix_offset, read_offset)`` is subtracted from that of ``[prefix_offset, end)``;
    while the result ends in U+FFFD (an incomplete character), nothing is emitted and the
    offsets stay, so the character comes out whole once its last byte arrives.
    """
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return full[len(prefix) :]
    return ""
