"""Prompt-lookup proposals: the longest suffix seen before, its latest occurrence, loops continued."""

from __future__ import annotations

import random

import pytest

from pagedllm.server.engine.spec_decode.ngram_proposer import NgramIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, num: int) -> list[int]:
    """What NgramIndex.propose must return, recomputed from scratch."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for end in range(size - 2, n - 2, -1):
            if tokens[end + 1 - n : end + 1] == suffix:
                num = num if n == max_n else min(num, n)
                extended = list(tokens)
                while len(extended) < end + 1 + num:
                    extended.append(extended[len(extended) - (size - 1 - end)])
                return extended[end + 1 : end + 1 + num]
    return []


def test_the_longest_suffix_wins_and_its_latest_occurrence():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 1, 2, 3, 9, 7, 2, 3, 8, 1, 2]
    # suffix [1, 2] (n=2) ends at 2 -> proposes tokens[3:]; [2] alone would match at 6 (later)
    assert index.propose(tokens, 3) == [3, 9]  # a 2-token match proposes at most 2
    assert NgramIndex(1, 2).propose(tokens, 3) == [3, 9, 7]  # the longest n proposes in full


def test_a_single_token_match_takes_the_latest():
    assert NgramIndex(1, 3).propose([4, 6, 4, 7, 4], 2) == [7]
    assert NgramIndex(1, 1).propose([4, 6, 4, 7, 4], 2) == [7, 4]


def test_a_loop_is_continued_past_the_end():
    index = NgramIndex(2, 2)
    assert index.propose([9, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]


def test_nothing_when_no_suffix_was_seen_or_nothing_is_asked():
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []
    assert NgramIndex(2, 3).propose([1, 2, 3, 1], 4) == []  # only a 1-gram repeats
    assert NgramIndex(1, 3).propose([1, 1], 0) == []
    assert NgramIndex(1, 3).propose([1], 3) == []


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("bounds", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_the_growing_index_matches_a_fresh_search(seed, bounds):
    rng = random.Random(seed)
    low, high = bounds
    tokens = [rng.randrange(4) for _ in range(5)]
    index = NgramIndex(low, high)
    for _ in range(60):
        num = rng.randrange(1, 6)
        assert index.propose(tokens, num) == brute_force(tokens, low, high, num)
        tokens.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))
