"""The detokenizer's shortcut to a fast tokenizer's backend gives exactly ``tokenizer.decode``'s text."""

from __future__ import annotations

import random

import pytest

from pagedllm.server.demo import build_byte_tokenizer
from pagedllm.server.engine.detokenizer import _plain_fast_backend, decode_new_text, text_decoder


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _windows(seed: int = 0):
    rng = random.Random(seed)
    for _ in range(200):  # bytes of multi-byte characters, specials (256-258) and plain ASCII mixed
        pool = [rng.randrange(259), 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 256, 257]
        yield [rng.choice(pool) for _ in range(rng.randrange(8))]


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_shortcut_decodes_exactly_as_the_tokenizer(tokenizer, clean_up):
    assert _plain_fast_backend(tokenizer) is not None  # NOTE: the shortcut is the path under test
    tokenizer.clean_up_tokenization_spaces = clean_up
    decode = text_decoder(tokenizer)
    for ids in _windows():
        for skip in (False, True):
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_with_its_own_decode_is_called_as_it_is():
    class Letters:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(ord("a") + i) for i in ids) + ("!" if skip_special_tokens else "")

    assert text_decoder(Letters())([0, 1], True) == "ab!"


def test_incremental_text_matches_decoding_the_whole_output(tokenizer):
    tokenizer.clean_up_tokenization_spaces = False
    decode = text_decoder(tokenizer)
    prompt = list("héllo".encode())
    out = list("→ café €5".encode())
    ids, text = list(prompt), ""
    prefix, read = max(len(prompt) - 5, 0), len(prompt)
    for token in out:
        ids.append(token)
        new, prefix, read = decode_new_text(decode, ids[prefix:], prefix, prefix, read, True)
        text += new
    assert text == tokenizer.decode(out) == "→ café €5"
